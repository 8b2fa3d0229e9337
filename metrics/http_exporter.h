// Serves a Registry's text exposition over HTTP (GET /metrics) on its own
// address, apart from the gRPC port, as Prometheus scrapes it.
#ifndef SHARDGEMM_METRICS_HTTP_EXPORTER_H_
#define SHARDGEMM_METRICS_HTTP_EXPORTER_H_

#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "metrics/metrics.h"

namespace httplib {
class Server;
}

namespace shardgemm::metrics {

class HttpExporter {
 public:
  // Listens on `address` ("HOST:PORT"; port 0 picks a free one) and serves
  // `registry`, which must outlive the exporter.
  static absl::StatusOr<std::unique_ptr<HttpExporter>> Start(const std::string& address,
                                                             const Registry* registry);
  ~HttpExporter();

  int port() const { return port_; }

 private:
  HttpExporter() = default;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace shardgemm::metrics

#endif  // SHARDGEMM_METRICS_HTTP_EXPORTER_H_
