// shardgemm-worker: owns one device, registers with the coordinator and runs
// the steps it is sent.
#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include <unistd.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/synchronization/mutex.h"
#include "platform/cpu_affinity.h"
#include "platform/local_socket.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/shardgemm.grpc.pb.h"
#include "proto/transport.h"
#include "logging/log.h"
#include "metrics/http_exporter.h"
#include "security/tls.h"
#include "security/tokens.h"
#include "worker/backend_factory.h"
#include "worker/device_runtime.h"
#include "worker/executor.h"
#include "worker/fault_injection.h"
#include "worker/gloo_collectives.h"
#include "worker/mesh_address.h"
#include "proto/grpc_status.h"
#include "worker/staging_area.h"
#include "worker/staging_service.h"
#include "worker/step_observer.h"
#include "worker/step_socket_server.h"
#include "worker/worker_service.h"
#include "platform/busy_poll.h"
#include "platform/busy_poll_flags.h"

ABSL_FLAG(std::string, cpus, "",
          "pin the process to these CPUs (a list such as 2, 2-3 or 0,4-7; empty: wherever the OS puts it): on a VM "
          "guest a wake-up that crosses cores costs several times one that stays, and a request hands off between "
          "threads several times");
ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051", "coordinator address (host:port)");
ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "address this worker serves on; port 0 picks a free port");
ABSL_FLAG(bool, local_socket, true,
          "also serve the coordinator on a Unix socket in a fresh directory only this user can enter (under "
          "$TMPDIR, else /tmp): a coordinator on this host, running as this user, calls there instead of over TCP, "
          "with gRPC's local credentials instead of TLS (the bytes never leave the kernel)");
ABSL_FLAG(bool, step_socket, true,
          "with --local_socket: also take steps on a step socket (framed steps on a Unix socket in a directory "
          "of its own, only this user's): a coordinator on this host sends steps there, a socket's round trip "
          "instead of a gRPC call's");
ABSL_FLAG(std::string, advertise_host, "",
          "host name or address the coordinator and the other workers reach this worker at "
          "(its gRPC port and its CPU collectives); default: the --listen host, which must then "
          "not be a wildcard (0.0.0.0, [::])");
ABSL_FLAG(std::string, backend, "auto", "auto | cpu | cuda (auto: cuda where a GPU is present)");
ABSL_FLAG(int, device, 0, "CUDA device ordinal");
ABSL_FLAG(int, threads, 0, "CPU backend threads (0: all cores)");
ABSL_FLAG(int64_t, memory_budget_mb, 4096, "resident shards + working memory budget, MiB");
ABSL_FLAG(int64_t, device_memory_budget_mb, -1,
          "device memory for resident shards kept on the device, MiB (-1: 80% of the device)");
ABSL_FLAG(int, collective_timeout_s, 60,
          "a collective whose peers do not all arrive within this fails the request");
ABSL_FLAG(int, register_timeout_s, 60, "how long to keep trying to reach the coordinator");
ABSL_FLAG(std::string, tls_dir, "",
          "certificates (ca.crt, worker.crt, worker.key; tools/make_certs.sh makes them): mutual TLS "
          "with the coordinator");
ABSL_FLAG(int, staging_port, 0,
          "port of the client-facing Staging service (clients stream request blocks here and fetch outputs), on "
          "the --listen host; 0: the OS picks one; -1: no staging (clients use the coordinator's inline path)");
ABSL_FLAG(std::string, staging_advertise, "",
          "HOST:PORT clients reach the staging service at (multi-host, NAT); default: the mesh host "
          "(--advertise_host or the --listen host) and the staging port");
ABSL_FLAG(int64_t, staging_budget, int64_t{1} << 30,
          "bytes of staged blocks and outputs held for direct fetch, together; past it a stage or a direct "
          "output is RESOURCE_EXHAUSTED");
ABSL_FLAG(int64_t, staging_pinned_mb, 512,
          "CUDA backend: pinned host memory (MiB) for outputs held for direct fetch, kept for reuse; past it "
          "they are held in pageable memory (they count against --staging_budget either way)");
ABSL_FLAG(double, staging_tenant_share, 0.5,
          "the fraction of --staging_budget one tenant may hold staged (blocks and outputs for fetch) on this "
          "worker, so one tenant cannot shut the others out; past it a stage is RESOURCE_EXHAUSTED naming the "
          "tenant; in (0, 1] (1: no bound but the budget). The anonymous tenant of a mesh without tokens is "
          "bounded by the budget alone");
ABSL_FLAG(absl::Duration, staged_block_ttl, absl::Seconds(60),
          "how long a ticket, a staged block or an output held for fetch waits to be used before it expires "
          "(its bytes freed); a block the coordinator streams for a put, how long it waits for its next chunk");
ABSL_FLAG(std::string, tokens_file, "",
          "clients' bearer tokens, checked on the staging port as the coordinator checks them (default with "
          "--tls_dir: its tokens file; without one there, no staging port)");
ABSL_FLAG(bool, insecure, false, "plaintext, unauthenticated calls (instead of --tls_dir)");
ABSL_FLAG(std::string, health_listen, "",
          "HOST:PORT for a plaintext gRPC health service only (for probes without TLS); empty: none");
ABSL_FLAG(std::string, metrics_listen, "",
          "HOST:PORT to serve Prometheus metrics on (GET /metrics); empty: no metrics");
ABSL_FLAG(bool, trace_steps, false,
          "log one step_marks line per step: its phases' instants in microseconds from its arrival in the "
          "handler, beside the wall-clock start (finding a fixed cost; costs a log line per step)");
ABSL_FLAG(std::string, log_format, "text", "text | json | logfmt: one line per step and event");
ABSL_FLAG(std::string, log_level, "info",
          "debug | info | warning | error (step lines are info; failed steps warning)");
ABSL_FLAG(std::string, fault_injection, "",
          "TEST ONLY (empty: off): real device errors on demand, as KIND:N[,KIND:N...]: kernel_launch:N (the Nth "
          "device kernel launch is made with an empty grid, which the runtime refuses), illegal_address:N (the Nth "
          "writes through an invalid address: a sticky error, after which the worker exits), nccl:N (the Nth "
          "collective call fails with NCCL's ncclInvalidArgument); CUDA backend only");

namespace shardgemm {
namespace {

// What a worker needs to build its collectives once it knows its place.
struct Mesher {
  std::string backend;
  int device = 0;
  std::shared_ptr<grpc::Channel> coordinator;
  std::string host;  // the mesh address (numeric): the only one the collectives bind
  std::chrono::milliseconds timeout;
  // --fault_injection's NCCL fault (null: none), wrapped around the collectives.
  FaultInjector* faults = nullptr;
  std::function<absl::Status()> nccl_fault;
};

// Sweeps a staging area every `period` until destroyed.
class Sweeper {
 public:
  Sweeper(StagingArea* area, absl::Duration period)
      : thread_([this, area, period] {
          while (!stop_.WaitForNotificationWithTimeout(period)) area->Sweep();
        }) {}
  ~Sweeper() {
    stop_.Notify();
    thread_.join();
  }

 private:
  absl::Notification stop_;
  std::thread thread_;
};

// The exit status of a worker whose device's CUDA context is lost.
constexpr int kExitDeviceLost = 3;

struct Joined {
  MeshPosition position;
  std::string session;
};

// Registers with the coordinator (retrying while it is unreachable, at most
// `patience`), then gives the executor its place, session and collectives.
// `stopping` (may be null): the worker is shutting down: no more tries.
absl::StatusOr<Joined> Join(v1::Coordination::Stub* stub, v1::RegisterRequest request, const ShardStore& store,
                            absl::Duration patience, const Mesher& mesher, Executor* executor,
                            const absl::Notification* stopping = nullptr) {
  // Steps of the old session still running end first (their collectives
  // time out): the new coordinator counts this worker ready once it answers.
  executor->AwaitIdle();
  request.clear_shards();
  for (std::string& name : store.Names()) request.add_shards(std::move(name));
  v1::RegisterResponse response;
  const absl::Time give_up = absl::Now() + patience;
  bool said_full = false;
  while (true) {
    if (stopping != nullptr && stopping->HasBeenNotified()) {
      return absl::UnavailableError("this worker is shutting down: not registering");
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    ctx.set_wait_for_ready(true);
    grpc::Status s = stub->Register(&ctx, request, &response);
    if (s.ok()) break;
    if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      // Every rank is taken and answering. A worker restarted at once after
      // a crash (a supervisor, a new port) replaces one the coordinator marks
      // down only after its heartbeat misses: keep trying, within patience.
      if (absl::Now() > give_up) {
        return absl::FailedPreconditionError(absl::StrCat("registration refused: ", s.error_message()));
      }
      if (!said_full) {
        said_full = true;
        logging::ProcessLogger().Log(
            logging::Level::kWarning, "mesh_full",
            {{"message", absl::StrCat(s.error_message(), "; trying again until a rank is free")}});
      }
    } else if (s.error_code() != grpc::StatusCode::UNAVAILABLE &&
               s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED) {
      return absl::FailedPreconditionError(absl::StrCat("registration refused: ", s.error_message()));
    } else if (absl::Now() > give_up) {
      return absl::UnavailableError("no coordinator answered the registration");
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  Joined joined;
  MeshPosition& position = joined.position;
  position.rank = response.rank();
  for (const auto& axis : response.mesh().axes()) {
    position.axis_names.push_back(axis.name());
    position.axis_sizes.push_back(axis.size());
  }
  int64_t rest = position.rank;
  position.coords.assign(position.axis_sizes.size(), 0);
  for (int d = static_cast<int>(position.axis_sizes.size()) - 1; d >= 0; --d) {
    position.coords[d] = rest % position.axis_sizes[d];
    rest /= position.axis_sizes[d];
  }
  std::unique_ptr<Collectives> collectives;
  if (position.NumWorkers() == 1) {
    collectives = MakeLocalCollectives(position);
  } else if (mesher.backend == "cuda") {
    collectives = MakeDeviceCollectives(position, mesher.device, mesher.coordinator, response.session() + "/",
                                        mesher.timeout);
  } else {
    // The CPU backend's collectives: Gloo over TCP, rendezvous through the coordinator.
    collectives = MakeGlooCollectives(position, MakeCoordinatorStore(mesher.coordinator, response.session() + "/", mesher.timeout),
                                      mesher.host, mesher.timeout);
  }
  if (mesher.nccl_fault != nullptr) {
    collectives = WithCollectiveFault(std::move(collectives), position, mesher.faults, mesher.nccl_fault);
  }
  executor->Configure(position, std::move(collectives), response.next_sequence(), response.session());
  joined.session = response.session();
  return joined;
}

int Run() {
  if (auto s = logging::ConfigureProcessLogger(absl::GetFlag(FLAGS_log_format), absl::GetFlag(FLAGS_log_level),
                                              "worker", /*background=*/true);
      !s.ok()) {
    std::cerr << "shardgemm-worker: " << s.message() << "\n";
    return 2;
  }
  auto transport = security::Transport::FromFlags(absl::GetFlag(FLAGS_tls_dir), absl::GetFlag(FLAGS_insecure),
                                                  security::Role::kWorker);
  if (!transport.ok()) {
    std::cerr << "shardgemm-worker: " << transport.status().message() << "\n";
    return 2;
  }
  if (transport->insecure()) {
    logging::ProcessLogger().Log(logging::Level::kWarning, "insecure",
                                 {{"message", "--insecure: plaintext calls, no identities checked"}});
  }
  auto fault_plan = ParseFaultPlan(absl::GetFlag(FLAGS_fault_injection));
  if (!fault_plan.ok()) {
    std::cerr << "shardgemm-worker: " << fault_plan.status().message() << "\n";
    return 2;
  }
  FaultInjector faults(*fault_plan);
  std::string note;
  auto backend = MakeBackend(absl::GetFlag(FLAGS_backend), absl::GetFlag(FLAGS_device),
                             absl::GetFlag(FLAGS_threads), &note, fault_plan->empty() ? nullptr : &faults);
  if (!backend.ok()) {
    std::cerr << "shardgemm-worker: " << backend.status() << "\n";
    return 1;
  }
  if (!note.empty()) std::cerr << "shardgemm-worker: " << note << "\n";
  std::function<absl::Status()> nccl_fault;
  if (!fault_plan->empty()) {
    if ((*backend)->Name() != "cuda") {
      std::cerr << "shardgemm-worker: --fault_injection needs the CUDA backend (its faults are CUDA and NCCL "
                   "errors); this worker runs the "
                << (*backend)->Name() << " backend\n";
      return 2;
    }
    if (fault_plan->nccl > 0) {
      nccl_fault = MakeDeviceNcclFault(absl::GetFlag(FLAGS_device));
      if (nccl_fault == nullptr) {
        std::cerr << "shardgemm-worker: --fault_injection: nccl needs a build with NCCL\n";
        return 2;
      }
    }
    logging::ProcessLogger().Log(
        logging::Level::kWarning, "fault_injection",
        {{"faults", fault_plan->ToString()},
         {"message", "TEST ONLY: the device errors named will be made on purpose and fail their requests"}});
  }

  // The mesh host: what the worker registers with (a name or an address).
  const std::string listen = absl::GetFlag(FLAGS_listen);
  std::string host = absl::GetFlag(FLAGS_advertise_host);
  if (host.empty()) host = listen.substr(0, listen.rfind(':'));
  if (host == "0.0.0.0" || host == "[::]" || host == "::" || host.empty()) {
    std::cerr << "shardgemm-worker: the mesh host '" << host << "' (--advertise_host, or the --listen host of "
              << listen << ") is a wildcard address; set --advertise_host to the name or address the "
                 "mesh reaches this worker at\n";
    return 1;
  }
  // Its address on this host is the only one the collectives bind: Gloo's
  // device is created on it, NCCL's bootstrap and sockets are pinned to its
  // interface (before any communicator exists). A name is retried while it
  // does not resolve here yet (a pod's DNS record comes after the pod).
  absl::StatusOr<NetInterface> mesh;
  const absl::Time resolve_until = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_register_timeout_s));
  while (true) {
    mesh = MeshInterface(host, LocalInterfaces());
    const bool name = CanonicalAddress(UnbracketHost(host)).empty();
    const bool may_come = mesh.status().code() == absl::StatusCode::kUnavailable ||
                          (name && mesh.status().code() == absl::StatusCode::kNotFound);
    if (mesh.ok() || !may_come || absl::Now() > resolve_until) break;
    absl::SleepFor(absl::Milliseconds(500));
  }
  if (!mesh.ok()) {
    std::cerr << "shardgemm-worker: the mesh address (--advertise_host, or the --listen host): "
              << mesh.status().message() << "\n";
    return 1;
  }
  // Said in the "serving" line.
  std::vector<logging::Field> pinned = {{"collectives_address", mesh->address}, {"interface", mesh->name}};
  if ((*backend)->Name() == "cuda") {
    const auto nccl = NcclSocketEnvironment(*mesh, [](const char* name) { return std::getenv(name); });
    for (const auto& [name, value] : nccl) {
      setenv(name.c_str(), value.c_str(), 1);
      pinned.push_back({name, value});
    }
    if (nccl.empty()) pinned.push_back({"NCCL_SOCKET_IFNAME", std::string(std::getenv("NCCL_SOCKET_IFNAME"))});
  }

  // Device memory for resident shards and kept outputs: by default most of
  // the device, leaving room for a step's working buffers.
  int64_t device_budget = absl::GetFlag(FLAGS_device_memory_budget_mb) * 1024 * 1024;
  if (device_budget < 0) device_budget = (*backend)->DeviceMemoryBytes() / 10 * 8;
  ShardStore store(absl::GetFlag(FLAGS_memory_budget_mb) * 1024 * 1024, device_budget);
  const absl::Duration staged_ttl = absl::GetFlag(FLAGS_staged_block_ttl);
  if (staged_ttl <= absl::ZeroDuration() || absl::GetFlag(FLAGS_staging_budget) < 0) {
    std::cerr << "shardgemm-worker: --staged_block_ttl must be positive and --staging_budget not negative\n";
    return 2;
  }
  const double tenant_share = absl::GetFlag(FLAGS_staging_tenant_share);
  if (!(tenant_share > 0 && tenant_share <= 1)) {
    std::cerr << "shardgemm-worker: --staging_tenant_share must be in (0, 1], got " << tenant_share << "\n";
    return 2;
  }
  const int64_t staging_budget = absl::GetFlag(FLAGS_staging_budget);
  if (absl::GetFlag(FLAGS_staging_pinned_mb) < 0) {
    std::cerr << "shardgemm-worker: --staging_pinned_mb must not be negative\n";
    return 2;
  }
  // Where staged blocks and held outputs live: the backend's choice (device
  // and pinned memory on CUDA, host memory on the CPU).
  auto staging_memory = (*backend)->MakeStagingMemory(absl::GetFlag(FLAGS_staging_pinned_mb) * 1024 * 1024);
  if (!staging_memory.ok()) {
    std::cerr << "shardgemm-worker: staging memory: " << staging_memory.status() << "\n";
    return 1;
  }
  StagingArea staging(staging_budget, staged_ttl, [] { return absl::Now(); },
                      static_cast<int64_t>(static_cast<double>(staging_budget) * tenant_share),
                      *std::move(staging_memory));
  // Clients' tokens for the staging port: the coordinator's file (TLS), none with --insecure.
  bool serve_staging = absl::GetFlag(FLAGS_staging_port) >= 0;
  std::unique_ptr<security::TokenFile> tokens;
  if (serve_staging && !transport->insecure()) {
    std::string tokens_file = absl::GetFlag(FLAGS_tokens_file);
    const bool named = !tokens_file.empty();
    if (!named) tokens_file = absl::GetFlag(FLAGS_tls_dir) + "/tokens";
    if (!named && access(tokens_file.c_str(), F_OK) != 0) {
      serve_staging = false;
      logging::ProcessLogger().Log(logging::Level::kWarning, "no_staging",
                                   {{"message", absl::StrCat("no clients' tokens file (", tokens_file,
                                                             "): no staging port; clients use the inline path")}});
    } else {
      auto loaded = security::TokenFile::Load(tokens_file);
      if (!loaded.ok()) {
        std::cerr << "shardgemm-worker: " << loaded.status().message() << "\n";
        return 2;
      }
      tokens = std::move(*loaded);
    }
  }
  Executor executor(backend->get(), &store, &staging);
  metrics::Registry registry;
  std::unique_ptr<metrics::HttpExporter> exporter;
  const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  StepObserver observer(&executor, &store, backend->get(), metrics_listen.empty() ? nullptr : &registry,
                        &logging::ProcessLogger());
  if (serve_staging && !metrics_listen.empty()) StepObserver::WatchStaging(&registry, &staging);
  if (!metrics_listen.empty()) {
    auto started = metrics::HttpExporter::Start(metrics_listen, &registry);
    if (!started.ok()) {
      std::cerr << "shardgemm-worker: " << started.status().message() << "\n";
      return 1;
    }
    exporter = std::move(*started);
  }
  auto busy_poll = platform::BusyPollOptionsFromFlags();
  if (!busy_poll.ok()) {
    std::cerr << "shardgemm-worker: " << busy_poll.status().message() << "\n";
    return 2;
  }
  platform::BusyPoller busy_poller(*busy_poll);
  WorkerServiceImpl service(&executor, &store, backend->get(), &observer, &*transport);
  service.SetBusyPoller(&busy_poller);
  service.SetTraceSteps(absl::GetFlag(FLAGS_trace_steps));
  if (serve_staging) service.SetStaging(&staging);
  // A lost CUDA context is for the process: report NOT_SERVING and exit, for
  // the supervisor to start a fresh worker (the coordinator marks the rank
  // down when its heartbeats fail).
  std::unique_ptr<grpc::Server> server, health;
  std::atomic<bool> device_lost{false};
  service.OnDeviceLost([&](const absl::Status& why) {
    device_lost = true;
    logging::ProcessLogger().Log(
        logging::Level::kError, "device_lost",
        {{"message", std::string(why.message())},
         {"action", absl::StrCat("health NOT_SERVING; exiting with status ", kExitDeviceLost,
                                 " for the supervisor to restart this worker")}});
    for (grpc::Server* s : {server.get(), health.get()}) {
      if (s != nullptr && s->GetHealthCheckService() != nullptr) s->GetHealthCheckService()->SetServingStatus(false);
    }
    StopServing();
  });

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  int health_port = 0;
  if (const std::string health_listen = absl::GetFlag(FLAGS_health_listen); !health_listen.empty()) {
    health = StartHealthOnlyServer(health_listen, &health_port);
    if (health == nullptr) {
      std::cerr << "shardgemm-worker: health_listen: cannot listen on " << health_listen << "\n";
      return 1;
    }
  }
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(listen, transport->ServerCredentials(), &port);
  std::optional<platform::PrivateSocketDir> socket_dir;
  if (absl::GetFlag(FLAGS_local_socket)) {
    const char* tmpdir = std::getenv("TMPDIR");
    const std::string socket_parent = tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp";
    // Killed workers' directories (SIGKILL leaves no time to remove them).
    if (const int removed = platform::RemoveStaleSocketDirs(socket_parent, "worker.sock", absl::Seconds(30)) +
                            platform::RemoveStaleSocketDirs(socket_parent, "steps.sock", absl::Seconds(30));
        removed > 0) {
      logging::ProcessLogger().Log(logging::Level::kInfo, "stale_local_sockets_removed", {{"count", removed}});
    }
    auto made = platform::PrivateSocketDir::Create(socket_parent, "worker.sock");
    if (made.ok()) {
      socket_dir = std::move(*made);
      builder.AddListeningPort(absl::StrCat("unix:", socket_dir->socket_path()), transport->LocalServerCredentials());
    } else {  // served over TCP only, as with --local_socket=false
      logging::ProcessLogger().Log(logging::Level::kWarning, "no_local_socket",
                                   {{"message", std::string(made.status().message())}});
    }
  }
  // Steps from a coordinator on this host: framed on a Unix socket of its own directory.
  std::optional<platform::PrivateSocketDir> step_socket_dir;
  std::unique_ptr<StepSocketServer> step_socket;
  if (socket_dir && absl::GetFlag(FLAGS_step_socket)) {
    const std::string& dir = socket_dir->dir();
    auto made = platform::PrivateSocketDir::Create(dir.substr(0, dir.rfind('/')), "steps.sock");
    absl::StatusOr<std::unique_ptr<StepSocketServer>> started =
        made.ok() ? StepSocketServer::Start(made->socket_path(),
                                            [&service](std::unique_ptr<v1::StepSocketRequest> request,
                                                       StepSocketServer::Reply reply) {
                                              service.ExecuteFromStepSocket(std::move(request), std::move(reply));
                                            })
                  : absl::StatusOr<std::unique_ptr<StepSocketServer>>(made.status());
    if (started.ok()) {
      step_socket_dir = std::move(*made);
      step_socket = std::move(*started);
    } else {  // steps come on gRPC
      logging::ProcessLogger().Log(logging::Level::kWarning, "no_step_socket",
                                   {{"message", std::string(started.status().message())}});
    }
  }
  ConfigureTensorServer(&builder);
  builder.RegisterService(&service);
  server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::cerr << "shardgemm-worker: cannot listen on " << listen
              << (socket_dir ? absl::StrCat(" and ", socket_dir->socket_path()) : "") << "\n";
    return 1;
  }
  const std::string address = absl::StrCat(host, ":", port);

  // The client-facing staging port: its own server, with the worker's
  // certificate (client certificates optional) and the clients' tokens.
  StagingServiceImpl staging_service(&staging, tokens.get());
  std::unique_ptr<grpc::Server> staging_server;
  std::string staging_address;
  if (serve_staging) {
    grpc::ServerBuilder staging_builder;
    int staging_port = 0;
    const std::string staging_listen =
        absl::StrCat(listen.substr(0, listen.rfind(':')), ":", absl::GetFlag(FLAGS_staging_port));
    staging_builder.AddListeningPort(staging_listen, transport->ClientFacingServerCredentials(), &staging_port);
    StagingServiceImpl::ConfigureServer(&staging_builder);
    staging_builder.RegisterService(&staging_service);
    staging_server = staging_builder.BuildAndStart();
    if (staging_server == nullptr || staging_port == 0) {
      std::cerr << "shardgemm-worker: staging_port: cannot listen on " << staging_listen << "\n";
      return 1;
    }
    staging_address = absl::GetFlag(FLAGS_staging_advertise);
    if (staging_address.empty()) staging_address = absl::StrCat(host, ":", staging_port);
    staging.set_worker_name(absl::StrCat("the worker at ", staging_address));
  }
  // Tickets and blocks nobody used expire on access, and here, a few times per TTL.
  Sweeper sweeper(&staging, std::clamp(staged_ttl / 4, absl::Milliseconds(100), absl::Seconds(1)));

  grpc::ChannelArguments args = TensorChannelArguments();
  auto channel = grpc::CreateCustomChannel(absl::GetFlag(FLAGS_coordinator), transport->ChannelCredentials(),
                                           args);
  auto stub = v1::Coordination::NewStub(channel);
  v1::RegisterRequest request;
  request.set_address(address);
  request.set_backend((*backend)->Name());
  request.set_device((*backend)->Device());
  request.set_memory_budget_bytes(store.budget_bytes());
  request.set_staging_address(staging_address);
  if (!staging_address.empty()) {
    request.set_staging_budget_bytes(staging.budget_bytes());
    request.set_staging_tenant_limit_bytes(staging.tenant_limit_bytes());
  }
  if (socket_dir) {
    auto inode = platform::SocketInode(socket_dir->socket_path());
    if (!inode.ok()) {
      std::cerr << "shardgemm-worker: local_socket: " << inode.status().message() << "\n";
      return 1;
    }
    v1::LocalSocket* local = request.mutable_local_socket();
    local->set_path(socket_dir->socket_path());
    local->set_boot_id(platform::BootId());
    local->set_inode(*inode);
  }
  if (step_socket != nullptr) {
    auto inode = platform::SocketInode(step_socket->path());
    if (!inode.ok()) {
      std::cerr << "shardgemm-worker: step_socket: " << inode.status().message() << "\n";
      return 1;
    }
    v1::LocalSocket* steps = request.mutable_step_socket();
    steps->set_path(step_socket->path());
    steps->set_boot_id(platform::BootId());
    steps->set_inode(*inode);
  }
  const Mesher mesher{(*backend)->Name(), absl::GetFlag(FLAGS_device), channel, mesh->address,
                      std::chrono::seconds(absl::GetFlag(FLAGS_collective_timeout_s)), &faults, nccl_fault};
  auto joined = Join(stub.get(), request, store, absl::Seconds(absl::GetFlag(FLAGS_register_timeout_s)), mesher,
                     &executor);
  if (!joined.ok()) {
    std::cerr << "shardgemm-worker: " << joined.status().message() << "\n";
    return 1;
  }
  MeshPosition position = joined->position;
  request.set_previous_rank(static_cast<int32_t>(position.rank));
  // A coordinator that restarts forgets its workers: watch its session and
  // register again when it changes, with the shards held (a coordinator
  // with a durable registry keeps those it knows and drops the others).
  absl::Notification stop_watching;
  std::thread watcher([&] {
    std::string session = joined->session;
    while (!stop_watching.WaitForNotificationWithTimeout(absl::Seconds(1))) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      v1::SessionResponse current;
      if (!stub->Session(&ctx, v1::SessionRequest(), &current).ok() || current.session() == session) continue;
      logging::ProcessLogger().Log(logging::Level::kWarning, "coordinator_restarted",
                                   {{"message", "the coordinator has a new session: registering again"}});
      auto again = Join(stub.get(), request, store, absl::Seconds(absl::GetFlag(FLAGS_register_timeout_s)), mesher,
                        &executor, &stop_watching);
      if (!again.ok()) {
        logging::ProcessLogger().Log(logging::Level::kError, "register_failed",
                                     {{"message", std::string(again.status().message())}});
        continue;
      }
      session = again->session;
      request.set_previous_rank(static_cast<int32_t>(again->position.rank));
      logging::ProcessLogger().Log(logging::Level::kInfo, "registered", {{"rank", again->position.rank}});
    }
  });
  std::vector<logging::Field> serving = {
      {"rank", position.rank}, {"address", address}, {"backend", (*backend)->Device()}};
  serving.push_back({"tls", !transport->insecure()});
  if (socket_dir) serving.push_back({"local_socket", socket_dir->socket_path()});
  if (step_socket != nullptr) serving.push_back({"step_socket", step_socket->path()});
  if (!staging_address.empty()) serving.push_back({"staging_address", staging_address});
  serving.insert(serving.end(), pinned.begin(), pinned.end());
  if (exporter != nullptr) serving.push_back({"metrics_port", exporter->port()});
  if (health != nullptr) serving.push_back({"health_port", health_port});
  logging::ProcessLogger().Log(logging::Level::kInfo, "serving", serving);
  // Supervisors and scripts wait for this line: it is written now, not with
  // the logger's next batch.
  logging::ProcessLogger().Flush();
  // Steps waiting for their turn end first (UNAVAILABLE): the server's
  // shutdown then waits for nothing their deadlines would hold.
  ServeUntilSignalled(server.get(), [&executor, &stop_watching] {
    stop_watching.Notify();  // a registration again (a restarted coordinator) is not tried now
    executor.Close();
  });
  if (device_lost) {
    // Nothing of the lost context is to be touched again (the backend's and
    // NCCL's teardown would be): the process ends here, its socket directory
    // removed first.
    socket_dir.reset();
    if (step_socket_dir) {
      ::unlink(step_socket_dir->socket_path().c_str());
      step_socket_dir.reset();
    }
    logging::ProcessLogger().Flush();
    std::cerr.flush();
    std::_Exit(kExitDeviceLost);
  }
  if (!stop_watching.HasBeenNotified()) stop_watching.Notify();
  watcher.join();
  if (staging_server != nullptr) staging_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  return 0;
}

}  // namespace
}  // namespace shardgemm

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("shardgemm-worker --coordinator=HOST:PORT [--backend=auto|cpu|cuda]");
  absl::ParseCommandLine(argc, argv);
  // Before any thread starts: they inherit it.
  auto cpus = shardgemm::platform::ParseCpuList(absl::GetFlag(FLAGS_cpus), "--cpus");
  const absl::Status pinned = cpus.ok() ? shardgemm::platform::PinToCpus(*cpus, "--cpus") : cpus.status();
  if (!pinned.ok()) {
    std::cerr << "shardgemm-worker: " << pinned.message() << "\n";
    return 2;
  }
  // The mutexes' deadlock graph costs a few percent of a request's CPU in a
  // server; the unit tests keep it on.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Gloo writes with writev: a peer that closed its side of a context (it
  // died, or revoked the context) must fail the collective (EPIPE), not
  // end this process silently.
  std::signal(SIGPIPE, SIG_IGN);
  return shardgemm::Run();
}
