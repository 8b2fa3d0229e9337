#!/bin/bash
# Two builds' quantize_bench side by side on the H200, alternated in one
# device call (a before/after claim needs both in the same run: the GPU's
# figures drift between calls). Bundle as quantize_gpu.sh says, then copy
# the earlier build's quantize_bench into the bundle as bin/quantize_bench_base.
#   ROUNDS=3 GREP='block1x128|mxfp8 row\+col  ' bash tools/gpu/quantize_alternate.sh
# The test binary runs first (TESTS=0 skips it). One log, $OUT/alternate.log.
set -uo pipefail
B=${BUNDLE:-.gpu_bundle/quant}
LOG=${OUT:-/tmp/quantize_alternate}
mkdir -p "$LOG"
L="$LOG/alternate.log"
: >"$L"
export LD_LIBRARY_PATH=$PWD/$B/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
[ -x "$B/bin/quantize_bench_base" ] || { echo "no $B/bin/quantize_bench_base" | tee -a "$L"; exit 2; }
rc=0
if [ "${TESTS:-1}" != 0 ]; then
  "$B/bin/quantize_gpu_test" --gtest_color=no 2>&1 | grep -E '^\[  (PASSED|FAILED)|Failure' >>"$L"
  rc=${PIPESTATUS[0]}
  echo "test rc=$rc" >>"$L"
fi
for r in $(seq "${ROUNDS:-3}"); do
  for b in quantize_bench_base quantize_bench; do
    echo "== $b round $r" >>"$L"
    "$B/bin/$b" ${ONLY:+--only "$ONLY"} 2>&1 | grep -E "HBM|${GREP:-row\+col  }" >>"$L"
  done
done
cat "$L"
exit $rc
