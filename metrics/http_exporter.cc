#include "metrics/http_exporter.h"

#include <httplib.h>
#include <sys/socket.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace shardgemm::metrics {

absl::StatusOr<std::unique_ptr<HttpExporter>> HttpExporter::Start(const std::string& address,
                                                                  const Registry* registry) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos || !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics_listen: '", address, "' is not HOST:PORT (port 0 picks a free one)"));
  }
  std::string host = address.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  std::unique_ptr<HttpExporter> exporter(new HttpExporter());
  exporter->server_ = std::make_unique<httplib::Server>();
  // SO_REUSEADDR only: httplib's default adds SO_REUSEPORT, which lets a
  // second process bind the same port and take half the scrapes.
  exporter->server_->set_socket_options([](int sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, reinterpret_cast<const char*>(&yes), sizeof(yes));
  });
  exporter->server_->Get("/metrics", [registry](const httplib::Request&, httplib::Response& res) {
    res.set_content(registry->Render(), "text/plain; version=0.0.4; charset=utf-8");
  });
  exporter->server_->Get("/", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("shardgemm metrics: GET /metrics\n", "text/plain");
  });
  if (port == 0) {
    port = exporter->server_->bind_to_any_port(host);
    if (port < 0) port = 0;
  } else if (!exporter->server_->bind_to_port(host, port)) {
    port = 0;
  }
  if (port <= 0) {
    return absl::UnavailableError(absl::StrCat("metrics_listen: cannot listen on ", address));
  }
  exporter->port_ = port;
  httplib::Server* server = exporter->server_.get();
  exporter->thread_ = std::thread([server] { server->listen_after_bind(); });
  // Until it runs, a stop() would be lost and the destructor's join hang.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (!server->is_running()) {
    if (absl::Now() > give_up) {
      return absl::InternalError(absl::StrCat("metrics_listen: the server on ", address, " did not start"));
    }
    absl::SleepFor(absl::Milliseconds(1));
  }
  return exporter;
}

HttpExporter::~HttpExporter() {
  if (server_ != nullptr) server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace shardgemm::metrics
