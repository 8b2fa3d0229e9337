#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for a
# bounded time: the planner (over its seed corpus) and the grouped quantize
# reference (kernels/cpu/quantize_fuzz_entry.h).
#   tools/run_fuzz.sh [SECONDS per target]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
out=.tmp/fuzz
mkdir -p "$out/corpus" "$out/quantize_corpus"
cxx="$(command -v clang++-14 || command -v clang++)"
flags=(-std=c++17 -g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -DSHARDGEMM_LIBFUZZER -I.)
absl_libs=$(grep -o '"-labsl_[a-z0-9_]*"' third_party/BUILD | tr -d '"')

"$cxx" "${flags[@]}" \
  planner/plan_fuzzer.cc planner/plan_fuzz_entry.cc \
  planner/planner.cc planner/plan_common.cc planner/plan_ragged_m.cc planner/plan_ragged_k.cc \
  planner/plan_quantize.cc planner/operand_text.cc \
  planner/spec.cc planner/mesh.cc kernels/dtype.cc \
  $absl_libs -lpthread -o "$out/plan_fuzzer"
cp planner/testdata/plan_fuzz_seeds/* "$out/corpus/"
"$out/plan_fuzzer" -max_total_time="$seconds" -max_len=512 -print_final_stats=1 -artifact_prefix="$out/" "$out/corpus"

# Requests are a header and the bytes of x: longer inputs reach bigger shapes.
"$cxx" "${flags[@]}" -ffp-contract=off \
  kernels/cpu/quantize_fuzzer.cc kernels/cpu/quantize_fuzz_entry.cc \
  kernels/cpu/quantize.cc kernels/fp8.cc kernels/dtype.cc \
  $absl_libs -lpthread -o "$out/quantize_fuzzer"
"$out/quantize_fuzzer" -max_total_time="$seconds" -max_len=4096 -len_control=0 -print_final_stats=1 -artifact_prefix="$out/quantize-" "$out/quantize_corpus"
