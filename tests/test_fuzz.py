"""The planner's libFuzzer target (ASan + UBSan) runs for a bounded time."""
import os
import subprocess

from conftest import ROOT


def test_plan_fuzzer_bounded_run():
    seconds = os.environ.get("SHARDGEMM_FUZZ_SECONDS", "20")
    r = subprocess.run(["bash", os.path.join(ROOT, "tools", "run_fuzz.sh"), seconds],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "stat::number_of_executed_units" in r.stderr
