#!/usr/bin/env bash
# Builds the planner's libFuzzer target with clang (ASan + UBSan) and runs it
# for a bounded time over the seed corpus: tools/run_fuzz.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
out=.tmp/fuzz
mkdir -p "$out/corpus"
"$(command -v clang++-14 || command -v clang++)" -std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined \
  -fno-sanitize-recover=undefined -DSHARDGEMM_LIBFUZZER -I. \
  server/planner/plan_fuzzer.cc server/planner/plan_fuzz_entry.cc \
  server/planner/planner.cc server/planner/operand_text.cc \
  server/planner/spec.cc server/planner/mesh.cc kernels/dtype.cc \
  $(grep -o '"-labsl_[a-z0-9_]*"' third_party/BUILD | tr -d '"') -lpthread \
  -o "$out/plan_fuzzer"
cp server/planner/testdata/plan_fuzz_seeds/* "$out/corpus/"
"$out/plan_fuzzer" -max_total_time="$seconds" -max_len=512 -print_final_stats=1 "$out/corpus"
