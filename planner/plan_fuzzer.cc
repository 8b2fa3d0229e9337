// libFuzzer target over the plan request (see docs/sharding.md, "Fuzzing").
// Built with clang++ -fsanitize=fuzzer -DSHARDGEMM_LIBFUZZER it is a real
// fuzzer; built by Bazel with g++ it is a replayer: it runs every file named
// on the command line (a corpus or a crash) through the same entry point.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

#include "planner/plan_fuzz_entry.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  shardgemm::planner::FuzzPlanOnce(data, size);
  return 0;
}

#ifndef SHARDGEMM_LIBFUZZER
int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    std::printf("%s: ok\n", argv[i]);
  }
  return 0;
}
#endif
