"""--busy_poll: the coordinator and the workers keep their cores from idling
while a request is in flight, with spinning threads at SCHED_IDLE priority
that yield to any work, and stop spinning once the linger after the last
request has passed (an idle service burns no CPU)."""
import os
import time

import numpy as np

from reference import assert_close

rng = np.random.default_rng(11)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime + stime


def _policies(pid):
    """The scheduling policy of each of the process's threads (0 other, 5 idle)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/sched") as f:
                for line in f:
                    if line.startswith("policy"):
                        out.append(int(line.split(":")[1]))
        except FileNotFoundError:  # the thread ended
            pass
    return out


def test_busy_poll_answers_right_spins_at_idle_priority_and_stops_when_idle(cluster_factory):
    flags = ["--busy_poll=50ms", "--busy_poll_cpus=1"]
    c = cluster_factory(mesh="dp=2", workers=2, coordinator_flags=flags, worker_flags=flags)
    lhs = rng.standard_normal((64, 32)).astype(np.float32)
    rhs = rng.standard_normal((2, 32, 16)).astype(np.float32)
    sizes = [10, 22, 16, 16]
    want = np.zeros((64, 16), np.float32)
    for shard in range(2):
        row = shard * 32
        for g, n in enumerate(sizes[shard * 2:(shard + 1) * 2]):
            want[row:row + n] = lhs[row:row + n] @ rhs[g]
            row += n
    for _ in range(20):
        out, _ = c.client.grouped_gemm(lhs, rhs, sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)")
        assert_close(out, want, 32)
    pids = [p.pid for _, p in c.procs]
    for pid in pids:
        policies = _policies(pid)
        assert policies.count(5) == 1, f"pid {pid}: one SCHED_IDLE spinner (--busy_poll_cpus=1), got {policies}"
        assert policies.count(0) >= 2, f"pid {pid}: the server's own threads stay SCHED_OTHER, got {policies}"
    # Idle: past the linger the processes use (next to) no CPU.
    time.sleep(0.5)
    before = [_cpu_seconds(pid) for pid in pids]
    time.sleep(1.0)
    used = [_cpu_seconds(pid) - b for pid, b in zip(pids, before)]
    assert all(u < 0.3 for u in used), f"CPU seconds used in 1 s idle: {used} (spinners left running?)"
    assert c.alive()


def test_busy_poll_refuses_a_negative_linger(tmp_path):
    import subprocess
    from conftest import BIN
    for binary in ("shardgemm-coordinator", "shardgemm-worker"):
        r = subprocess.run([os.path.join(BIN, binary), "--insecure", "--busy_poll=-1ms"], capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 2, (binary, r.returncode, r.stderr)
        assert "--busy_poll=-1ms: must not be negative" in r.stderr, r.stderr
