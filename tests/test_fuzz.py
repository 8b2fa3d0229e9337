"""The libFuzzer targets (ASan + UBSan), the planner's and the quantize
reference's, run for a bounded time each."""
import os
import subprocess

from conftest import ROOT


def test_fuzzers_bounded_run():
    seconds = os.environ.get("SHARDGEMM_FUZZ_SECONDS", "20")
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "run_fuzz.sh"), seconds],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    # Both targets ran and reported their executions.
    assert r.stderr.count("stat::number_of_executed_units") == 2, r.stderr[-4000:]
