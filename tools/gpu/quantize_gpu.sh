#!/bin/bash
# Grouped quantize on the H200: the GPU test binary (bit-identity with the CPU
# reference, FP8 GEMM tolerances), the bandwidth bench, and a short
# compute-sanitizer memcheck pass. No Bazel there: build and bundle here first.
#
#   bazel --output_base=/tmp/bazel_quant build -c opt --symlink_prefix=/ \
#       //kernels/cuda:quantize_gpu_test //kernels/cuda:quantize_bench
#   BIN=$(bazel --output_base=/tmp/bazel_quant info -c opt bazel-bin)/kernels/cuda
#   /work/shared/tools/bundle-for-gpu .gpu_bundle/quant $BIN/quantize_gpu_test $BIN/quantize_bench
#
# Then, through the device tool: carry [".gpu_bundle/quant"], command
#   bash tools/gpu/quantize_gpu.sh
# Logs go to $OUT (the device tool's output folder) or /tmp/quantize_gpu.
# SANITIZE=0 skips the compute-sanitizer passes (about 4 of the script's
# 6.5 minutes on the H200: run them once per change of the kernels).
set -uo pipefail
B=${BUNDLE:-.gpu_bundle/quant}
LOG=${OUT:-/tmp/quantize_gpu}
mkdir -p "$LOG"
export LD_LIBRARY_PATH=$PWD/$B/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
date -u
echo "== quantize_gpu_test"
"$B/bin/quantize_gpu_test" --gtest_color=no 2>&1 | tee "$LOG/quantize_gpu_test.log" | grep -vE '^\[ RUN|^\[       OK' 
test_rc=${PIPESTATUS[0]}
echo "== quantize_bench"
"$B/bin/quantize_bench" 2>&1 | tee "$LOG/quantize_bench.log"
bench_rc=${PIPESTATUS[0]}
echo "== compute-sanitizer memcheck (small cases)"
if [ "${SANITIZE:-1}" != 0 ] && command -v compute-sanitizer >/dev/null; then
  # LargeUnevenGroups: the whole-tile paths of every mode, partial tiles and NaN
  # blocks; OneShot*: the one-shot kernel (its grid barrier included);
  # TwoPassAmaxSlots*: the two-pass path's workspace slots.
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 3 "$B/bin/quantize_gpu_test" \
    --gtest_filter='*SoftwareConversion*:*Rejects*:*LargeUnevenGroups*:*OneShot*:*TwoPassAmaxSlots*:Fp8GemmGpuTest.TensorScalingE4M3' \
    >"$LOG/memcheck.log" 2>&1
  echo "memcheck rc=$?"; tail -4 "$LOG/memcheck.log"
  # Shared-memory races and barrier misuse: the one-shot kernel's exchange and
  # transpose, the tiled kernels' staging (software-conversion cases).
  for tool in racecheck synccheck; do
    timeout 200 compute-sanitizer --tool $tool --error-exitcode 3 "$B/bin/quantize_gpu_test" \
      --gtest_filter='*OneShot*:*SoftwareConversion*:*BitIdenticalToCpu*' >"$LOG/$tool.log" 2>&1
    rc=$?; echo "$tool rc=$rc"; tail -2 "$LOG/$tool.log"
    sanitizer_rc=$(( ${sanitizer_rc:-0} | rc ))
  done
fi
echo "test rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc | bench_rc | ${sanitizer_rc:-0} ))
