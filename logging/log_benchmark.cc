// What one request's log line costs to format, by format.
#include <sstream>

#include "benchmark/benchmark.h"
#include "logging/log.h"

namespace shardgemm::logging {
namespace {

void BM_RequestLine(benchmark::State& state) {
  const Format format = static_cast<Format>(state.range(0));
  Logger logger(format, Level::kInfo, nullptr);
  logger.set_component("coordinator");
  for (auto _ : state) {
    std::vector<Field> fields = {{"request_id", "5f3a9c1e2b7d4a60"},
                                 {"op", "grouped_gemm"},
                                 {"code", "OK"},
                                 {"elapsed_ms", 0.2871},
                                 {"plan", "grouped_gemm_ragged_m m k, g k n, g -> m n; before all_gather(rhs, dim 1, fsdp); out ((fsdp, ep), None)"},
                                 {"server_ms", 0.2512},
                                 {"worker_ms", 0.0293},
                                 {"bytes_in", int64_t{1234}},
                                 {"bytes_out", int64_t{5678}}};
    benchmark::DoNotOptimize(logger.FormatLine(Level::kInfo, "request", fields));
  }
}
BENCHMARK(BM_RequestLine)->Arg(static_cast<int>(Format::kText))->Arg(static_cast<int>(Format::kJson))
    ->Arg(static_cast<int>(Format::kLogfmt));

}  // namespace
}  // namespace shardgemm::logging
