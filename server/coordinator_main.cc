// shardgemm-coordinator: owns the mesh, plans requests and dispatches them to
// the workers that register with it.
#include <sys/stat.h>

#include <csignal>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/time/time.h"
#include "gperftools/malloc_extension.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/synchronization/mutex.h"
#include "platform/cpu_affinity.h"
#include "platform/local_socket.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "logging/log.h"
#include "metrics/http_exporter.h"
#include "security/tls.h"
#include "security/tokens.h"
#include "server/coordinator.h"
#include "server/request_observer.h"
#include "platform/busy_poll.h"
#include "platform/busy_poll_flags.h"
#include "proto/transport.h"
#include "server/call_socket.h"
#include "server/service.h"

ABSL_FLAG(bool, shared_memory, false,
          "let same-host clients name POSIX shared-memory regions as tensor sources and output destinations "
          "(RegisterSharedMemory); the workers map them, so they must share the client's host, and a client may "
          "name any object the service's user can open (docs/security.md)");
ABSL_FLAG(std::string, cpus, "",
          "pin the process to these CPUs (a list such as 2, 2-3 or 0,4-7; empty: wherever the OS puts it): on a VM "
          "guest a wake-up that crosses cores costs several times one that stays, and a request hands off between "
          "threads several times");
ABSL_FLAG(std::string, listen, "127.0.0.1:50051", "address to serve clients and workers on");
ABSL_FLAG(std::string, client_socket, "",
          "also serve clients on a Unix socket at this absolute path (clients target unix:PATH), in a directory "
          "of this user's that no one else can write: one kernel hop instead of loopback TCP. With --tls_dir it "
          "takes gRPC's local credentials (the kernel vouches that the peer is on this host; no encryption) and "
          "tokens are still checked; workers keep --listen (their certificates are TCP's). A socket a killed "
          "coordinator left is replaced; anything else there is an error. Empty: none");
ABSL_FLAG(std::string, client_socket_mode, "0600",
          "the --client_socket file's mode, octal: 0600 lets this user's processes connect, 0660 its group's too");
ABSL_FLAG(std::string, call_socket, "",
          "also take same-host clients' GroupedGemm calls as frames on a Unix socket at this absolute path "
          "(shardgemm-service-bench --call_socket, ShardGemmClient::UseCallSocket), in a directory of this user's "
          "that no one else can write: a socket round trip instead of a gRPC call's thread hand-offs. Only this "
          "user's processes may connect (owner-only, peer credentials checked); tokens are checked as on gRPC; "
          "a request larger than --max_message_mb goes on gRPC. Empty: none");
ABSL_FLAG(int64_t, max_message_mb, 2047,
          "the largest message a client may send or be sent, MiB (1-2047): an inline request or response over it "
          "is refused with RESOURCE_EXHAUSTED; PutTensor and GetTensor stream larger tensors in 1 MiB chunks");
ABSL_FLAG(std::string, mesh, "dp=1", "mesh axes and sizes, e.g. 'dp=2,fsdp=2,ep=2'");
ABSL_FLAG(std::string, roles, "",
          "which axis plays dp/fsdp/ep/tp, e.g. 'dp=data,ep=expert'; axes named dp, fsdp, ep, "
          "tp play their own role by default");

ABSL_FLAG(absl::Duration, staging_ttl, absl::Seconds(60),
          "how long a transfer plan (PlanStaging) waits for the request that names it (the workers expire its "
          "tickets by their own --staged_block_ttl)");
ABSL_FLAG(absl::Duration, step_timeout, absl::Seconds(120),
          "the longest a request's steps may take on the workers (queueing included) when the "
          "client sets no earlier deadline, and the longest a streamed put waits for its client's next "
          "chunk, as an absl duration (5s, 1m30s, 500ms)");
ABSL_FLAG(double, step_timeout_s, 0, "the same in seconds (kept for older scripts; 0: --step_timeout decides)");

ABSL_FLAG(std::string, tls_dir, "",
          "certificates (ca.crt, coordinator.crt, coordinator.key; tools/make_certs.sh makes them): TLS "
          "for clients, mutual TLS with the workers");
ABSL_FLAG(bool, insecure, false, "plaintext, unauthenticated calls (instead of --tls_dir)");
ABSL_FLAG(std::string, tokens_file, "",
          "clients' bearer tokens, by SHA-256 with their tenant (default with --tls_dir: its tokens file)");
ABSL_FLAG(std::string, health_listen, "",
          "HOST:PORT for a plaintext gRPC health service only (for probes without TLS); empty: none");
ABSL_FLAG(bool, reflection, true, "serve gRPC server reflection on the client port");
ABSL_FLAG(double, heartbeat_interval_s, 1,
          "how often the coordinator pings every worker (0: never); a worker that misses "
          "--heartbeat_misses in a row is marked down: the mesh is not ready, requests fail at once "
          "naming it, and a worker registering from another address may take its rank");
ABSL_FLAG(int, heartbeat_misses, 3, "missed heartbeats in a row that mark a worker down");
ABSL_FLAG(bool, worker_local_socket, true,
          "call a worker on this host on its Unix socket (a private directory of this user's; gRPC's local "
          "credentials, no TLS: the bytes never leave the kernel) instead of over TCP with mutual TLS");
ABSL_FLAG(bool, worker_step_socket, true,
          "with --worker_local_socket: send a worker on this host its steps on its step socket (framed steps on "
          "a Unix socket in the same private directory: a socket's round trip instead of a gRPC call's); its "
          "other calls stay on gRPC");
ABSL_FLAG(std::string, state_dir, "",
          "keep the registry of resident tensors here (fsync'd on every put and delete), so a restarted "
          "coordinator lists and serves them again; empty: in memory only");
ABSL_FLAG(int, replicas, 1,
          "workers holding each block of a resident tensor (1 to the mesh's size): with 2 or more, each block "
          "also lives on other workers as standby copies (counted against their --memory_budget_mb), and a worker "
          "that takes a replaced worker's rank gets its copies back from them; with 1 they are lost");
ABSL_FLAG(int64_t, max_tensors_per_tenant, 10000, "resident tensors one tenant may hold (0: no limit)");
ABSL_FLAG(int, max_requests_per_tenant, 64,
          "GEMM, quantize, put and get requests one tenant may have running at once (0: no limit)");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT to serve Prometheus metrics on (GET /metrics); empty: no metrics");
ABSL_FLAG(bool, trace_requests, false,
          "log one request_marks line per GroupedGemm: its phases' instants in microseconds from its arrival in "
          "the handler, beside the wall-clock start (finding a fixed cost; costs a log line per request)");
ABSL_FLAG(std::string, log_format, "text", "text | json | logfmt: one line per request and event");
ABSL_FLAG(std::string, log_level, "info",
          "debug | info | warning | error (request lines are info; failed requests warning)");

namespace shardgemm {
namespace {

// How long a shutdown waits for the call socket's calls in flight: the
// coordinator answers every one of them once it abandons its requests.
constexpr absl::Duration kSocketCallsShutdownBound = absl::Seconds(10);

int Run() {
  if (auto s = logging::ConfigureProcessLogger(absl::GetFlag(FLAGS_log_format), absl::GetFlag(FLAGS_log_level),
                                              "coordinator", /*background=*/true);
      !s.ok()) {
    std::cerr << "shardgemm-coordinator: " << s.message() << "\n";
    return 2;
  }
  auto transport = security::Transport::FromFlags(absl::GetFlag(FLAGS_tls_dir), absl::GetFlag(FLAGS_insecure),
                                                  security::Role::kCoordinator);
  if (!transport.ok()) {
    std::cerr << "shardgemm-coordinator: " << transport.status().message() << "\n";
    return 2;
  }
  std::unique_ptr<security::TokenFile> tokens;
  if (transport->insecure()) {
    logging::ProcessLogger().Log(logging::Level::kWarning, "insecure",
                                 {{"message", "--insecure: plaintext calls, clients and workers not authenticated"}});
  } else {
    std::string tokens_file = absl::GetFlag(FLAGS_tokens_file);
    if (tokens_file.empty()) tokens_file = absl::GetFlag(FLAGS_tls_dir) + "/tokens";
    auto loaded = security::TokenFile::Load(tokens_file);
    if (!loaded.ok()) {
      std::cerr << "shardgemm-coordinator: " << loaded.status().message() << "\n";
      return 2;
    }
    tokens = std::move(*loaded);
  }
  auto max_message_bytes = MaxMessageBytesFromMiB(absl::GetFlag(FLAGS_max_message_mb), "--max_message_mb");
  if (!max_message_bytes.ok()) {
    std::cerr << "shardgemm-coordinator: " << max_message_bytes.status().message() << "\n";
    return 2;
  }
  auto mesh = planner::ParseMesh(absl::GetFlag(FLAGS_mesh), absl::GetFlag(FLAGS_roles));
  if (!mesh.ok()) {
    std::cerr << "shardgemm-coordinator: --mesh/--roles: " << mesh.status().message() << "\n";
    return 2;
  }
  const absl::Duration step_timeout = absl::GetFlag(FLAGS_step_timeout_s) != 0
                                         ? absl::Seconds(absl::GetFlag(FLAGS_step_timeout_s))
                                         : absl::GetFlag(FLAGS_step_timeout);
  if (!(step_timeout > absl::ZeroDuration()) || step_timeout == absl::InfiniteDuration()) {
    std::cerr << "shardgemm-coordinator: --step_timeout (or --step_timeout_s) must be positive and finite "
                 "(every step's wait on the workers is bounded by it)\n";
    return 2;
  }
  CoordinatorOptions options;
  options.step_timeout = step_timeout;
  options.max_tensors_per_tenant = absl::GetFlag(FLAGS_max_tensors_per_tenant);
  if (!(absl::GetFlag(FLAGS_heartbeat_interval_s) >= 0) || absl::GetFlag(FLAGS_heartbeat_misses) < 1) {
    std::cerr << "shardgemm-coordinator: --heartbeat_interval_s must be >= 0 and --heartbeat_misses >= 1\n";
    return 2;
  }
  options.heartbeat_interval = absl::Seconds(absl::GetFlag(FLAGS_heartbeat_interval_s));
  options.heartbeat_misses = absl::GetFlag(FLAGS_heartbeat_misses);
  options.allow_shared_memory = absl::GetFlag(FLAGS_shared_memory);
  options.prefer_local_socket = absl::GetFlag(FLAGS_worker_local_socket);
  options.prefer_step_socket = absl::GetFlag(FLAGS_worker_step_socket);
  options.replicas = absl::GetFlag(FLAGS_replicas);
  options.staging_ttl = absl::GetFlag(FLAGS_staging_ttl);
  if (options.staging_ttl <= absl::ZeroDuration()) {
    std::cerr << "shardgemm-coordinator: --staging_ttl must be positive\n";
    return 2;
  }
  if (options.replicas < 1 || options.replicas > planner::NumWorkers(*mesh)) {
    std::cerr << "shardgemm-coordinator: --replicas=" << options.replicas << " must be within 1 and the "
              << planner::NumWorkers(*mesh) << " workers of --mesh=" << planner::FormatMesh(*mesh) << "\n";
    return 2;
  }
  std::shared_ptr<grpc::ChannelCredentials> worker_credentials = transport->ChannelCredentials();
  std::shared_ptr<grpc::ChannelCredentials> local_worker_credentials = transport->LocalChannelCredentials();
  // Before the coordinator, so it outlives the coordinator's epoch listener.
  RendezvousStore rendezvous;
  Coordinator coordinator(
      *mesh,
      [worker_credentials, local_worker_credentials](const std::string& target) {
        return MakeGrpcWorkerChannel(
            target, absl::StartsWith(target, "unix:") ? local_worker_credentials : worker_credentials);
      },
      options);
  if (const std::string state_dir = absl::GetFlag(FLAGS_state_dir); !state_dir.empty()) {
    if (auto s = coordinator.MakeDurable(state_dir); !s.ok()) {
      std::cerr << "shardgemm-coordinator: " << s.message() << "\n";
      return 2;
    }
  }
  metrics::Registry registry;
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  RequestObserver observer(&coordinator, metrics_listen.empty() ? nullptr : &registry,
                           &logging::ProcessLogger());
  std::unique_ptr<metrics::HttpExporter> exporter;
  if (!metrics_listen.empty()) {
    auto started = metrics::HttpExporter::Start(metrics_listen, &registry);
    if (!started.ok()) {
      std::cerr << "shardgemm-coordinator: " << started.status().message() << "\n";
      return 1;
    }
    exporter = std::move(*started);
  }
  auto busy_poll = platform::BusyPollOptionsFromFlags();
  if (!busy_poll.ok()) {
    std::cerr << "shardgemm-coordinator: " << busy_poll.status().message() << "\n";
    return 2;
  }
  platform::BusyPoller busy_poller(*busy_poll);
  ShardGemmService service(&coordinator, &observer, tokens.get(), absl::GetFlag(FLAGS_max_requests_per_tenant));
  service.SetBusyPoller(&busy_poller);
  service.SetTraceRequests(absl::GetFlag(FLAGS_trace_requests));
  // A large request's buffers (a put's blocks, a get's tensor) go back to
  // the system once freed; small requests leave the allocator's cache alone.
  service.SetFreeMemoryReleaser([] {
    size_t free_bytes = 0;
    if (MallocExtension::instance()->GetNumericProperty("tcmalloc.pageheap_free_bytes", &free_bytes) &&
        free_bytes > (size_t{64} << 20)) {
      MallocExtension::instance()->ReleaseFreeMemory();
    }
  });
  rendezvous.AdvanceEpoch(coordinator.ClusterInfo().epoch());
  coordinator.SetEpochListener([&rendezvous](uint64_t epoch) { rendezvous.AdvanceEpoch(epoch); });
  CoordinationService coordination(&coordinator, &rendezvous, &*transport);
  if (!metrics_listen.empty()) {
    auto* keys = registry.AddGauge("shardgemm_rendezvous_keys",
                                   "Keys in the workers' rendezvous store (forgotten once a communicator is built).");
    auto* bytes = registry.AddGauge("shardgemm_rendezvous_bytes", "Bytes in the workers' rendezvous store.");
    registry.AddCollector([&rendezvous, keys, bytes] {
      keys->With({})->Set(static_cast<double>(rendezvous.num_keys()));
      bytes->With({})->Set(static_cast<double>(rendezvous.num_bytes()));
    });
  }

  grpc::EnableDefaultHealthCheckService(true);
  if (absl::GetFlag(FLAGS_reflection)) grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  std::unique_ptr<grpc::Server> health;
  int health_port = 0;
  if (const std::string health_listen = absl::GetFlag(FLAGS_health_listen); !health_listen.empty()) {
    health = StartHealthOnlyServer(health_listen, &health_port);
    if (health == nullptr) {
      std::cerr << "shardgemm-coordinator: health_listen: cannot listen on " << health_listen << "\n";
      return 1;
    }
  }
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(absl::GetFlag(FLAGS_listen), transport->ServerCredentials(), &port);
  const std::string client_socket = absl::GetFlag(FLAGS_client_socket);
  std::optional<platform::SocketPathClaim> client_socket_claim;  // held while serving; removes the socket
  absl::StatusOr<unsigned> client_socket_mode = 0600u;
  if (!client_socket.empty()) {
    client_socket_mode = platform::ParseSocketMode(absl::GetFlag(FLAGS_client_socket_mode), "--client_socket_mode");
    auto claimed = client_socket_mode.ok() ? platform::ClaimSocketPath(client_socket, "--client_socket")
                                           : absl::StatusOr<platform::SocketPathClaim>(client_socket_mode.status());
    if (!claimed.ok()) {
      std::cerr << "shardgemm-coordinator: " << claimed.status().message() << "\n";
      return 2;
    }
    client_socket_claim.emplace(*std::move(claimed));
    builder.AddListeningPort(absl::StrCat("unix:", client_socket), transport->LocalServerCredentials());
  }
  ConfigureTensorServer(&builder, *max_message_bytes);
  builder.RegisterService(&service);
  builder.RegisterService(&coordination);
  // The socket is bound inside BuildAndStart: owner-only from the start,
  // then given its mode, so no one else can connect in between.
  std::optional<mode_t> umask_before;
  if (client_socket_claim) umask_before = umask(0177);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (umask_before) umask(*umask_before);
  if (server == nullptr || port == 0) {
    std::cerr << "shardgemm-coordinator: cannot listen on " << absl::GetFlag(FLAGS_listen)
              << (client_socket.empty() ? "" : absl::StrCat(" and unix:", client_socket)) << "\n";
    return 1;
  }
  if (client_socket_claim) {
    if (absl::Status s = client_socket_claim->Bound(*client_socket_mode); !s.ok()) {
      std::cerr << "shardgemm-coordinator: --client_socket: " << s.message() << "\n";
      return 1;
    }
  }
  // The call socket after the server: stopped first, so no call arrives
  // once the coordinator abandons its requests.
  const std::string call_socket_path = absl::GetFlag(FLAGS_call_socket);
  std::optional<platform::SocketPathClaim> call_socket_claim;
  std::unique_ptr<FrameSocketServer> call_socket;
  if (!call_socket_path.empty()) {
    auto claimed = platform::ClaimSocketPath(call_socket_path, "--call_socket");
    if (!claimed.ok()) {
      std::cerr << "shardgemm-coordinator: " << claimed.status().message() << "\n";
      return 2;
    }
    call_socket_claim.emplace(*std::move(claimed));
    const mode_t umask_before_call_socket = umask(0177);
    auto started = StartCallSocket(call_socket_path, &service, static_cast<uint64_t>(*max_message_bytes) + 4096);
    umask(umask_before_call_socket);
    absl::Status bound = started.ok() ? call_socket_claim->Bound(0600) : started.status();
    if (!bound.ok()) {
      std::cerr << "shardgemm-coordinator: --call_socket: " << bound.message() << "\n";
      return 1;
    }
    call_socket = *std::move(started);
  }
  std::vector<logging::Field> serving = {{"mesh", planner::FormatMesh(*mesh)},
                                         {"workers_expected", planner::NumWorkers(*mesh)},
                                         {"port", port},
                                         {"tls", !transport->insecure()}};
  if (!client_socket.empty()) serving.push_back({"client_socket", client_socket});
  if (call_socket != nullptr) serving.push_back({"call_socket", call_socket_path});
  if (health != nullptr) serving.push_back({"health_port", health_port});
  if (exporter != nullptr) serving.push_back({"metrics_port", exporter->port()});
  logging::ProcessLogger().Log(logging::Level::kInfo, "serving", serving);
  logging::ProcessLogger().Flush();  // the line supervisors wait for, written now

  ServeUntilSignalled(server.get(), [&coordinator, &call_socket, &service] {
    // No socket call starts once the coordinator abandons its requests; the
    // ones in flight are answered (UNAVAILABLE, or their result) before the
    // service and the coordinator go, as gRPC's are before Wait returns.
    // A handler still running, or a call unfinished, would answer on a
    // service that is gone: end here rather than later in a freed one.
    auto end_now = []() {
      logging::ProcessLogger().Flush();
      std::_Exit(1);
    };
    // Abandoned, the coordinator answers every request waiting on workers,
    // and any later one, UNAVAILABLE at once: a handler blocked in one
    // (GroupedQuantize) returns.
    if (call_socket != nullptr) call_socket->StopReading(absl::ZeroDuration());
    coordinator.AbandonRequests();
    if (call_socket != nullptr && !call_socket->StopReading(kSocketCallsShutdownBound)) {
      logging::ProcessLogger().Log(logging::Level::kError, "call_socket_not_stopped",
                                   {{"message", "a call socket handler still ran at the shutdown's bound"}});
      end_now();
    }
    if (call_socket != nullptr && !service.WaitForSocketCalls(kSocketCallsShutdownBound)) {
      end_now();  // WaitForSocketCalls logged how many
    }
    if (call_socket != nullptr && !call_socket->FlushReplies(kSocketCallsShutdownBound)) {
      logging::ProcessLogger().Log(logging::Level::kWarning, "call_socket_replies_unsent",
                                   {{"message", "a client read its reply too slowly for the shutdown's bound"}});
    }
  });
  logging::ProcessLogger().Log(logging::Level::kInfo, "stopped", {});
  return 0;
}

}  // namespace
}  // namespace shardgemm

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("shardgemm-coordinator --mesh='dp=2,ep=2' [--listen=HOST:PORT]");
  absl::ParseCommandLine(argc, argv);
  // Before any thread starts: they inherit it.
  auto cpus = shardgemm::platform::ParseCpuList(absl::GetFlag(FLAGS_cpus), "--cpus");
  const absl::Status pinned = cpus.ok() ? shardgemm::platform::PinToCpus(*cpus, "--cpus") : cpus.status();
  if (!pinned.ok()) {
    std::cerr << "shardgemm-coordinator: " << pinned.message() << "\n";
    return 2;
  }
  // The mutexes' deadlock graph costs a few percent of a request's CPU in a
  // server; the unit tests keep it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  return shardgemm::Run();
}
