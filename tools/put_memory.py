"""The coordinator's memory around one large PutTensor: its resident set when
idle, its high-water mark during the put (sampled every 5 ms, and VmHWM),
after the put and after the delete, against the payload. Starts its own CPU
mesh on loopback (tests/conftest.py's Cluster, --insecure).

    python3 tools/put_memory.py                       # 1 GiB, replicated, one worker
    MIB=1024 SPEC="(dp, None)" MESH=dp=2 W=2 python3 tools/put_memory.py
"""
import os
import pathlib
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "client" / "python"), str(ROOT / "tests")]
import numpy as np  # noqa: E402
from conftest import Cluster  # noqa: E402


def status_mib(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def main():
    mib = int(os.environ.get("MIB", "1024"))
    spec = os.environ.get("SPEC", "()")
    c = Cluster(pathlib.Path(tempfile.mkdtemp()), mesh=os.environ.get("MESH", "dp=1"),
                workers=int(os.environ.get("W", "1")), worker_flags=["--memory_budget_mb=8192"])
    try:
        pid = c.coordinator.pid
        x = np.random.default_rng(0).standard_normal((mib * 256, 1024)).astype(np.float32)
        idle = status_mib(pid, "VmRSS")
        peak = [idle]
        done = threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], status_mib(pid, "VmRSS"))
                time.sleep(0.005)

        watcher = threading.Thread(target=watch)
        watcher.start()
        start = time.time()
        c.client.put("big", x, spec=spec)
        seconds = time.time() - start
        after_put = status_mib(pid, "VmRSS")
        c.client.delete("big")
        done.set()
        watcher.join(timeout=5)
        assert not watcher.is_alive()
        high = max(peak[0], status_mib(pid, "VmHWM"))
        print(f"payload {mib} MiB ({spec}, mesh {os.environ.get('MESH', 'dp=1')}): idle {idle:.0f} MiB, "
              f"peak {high:.0f} MiB = idle + {(high - idle) / mib:.2f}x the payload, after the put {after_put:.0f}, "
              f"after the delete {status_mib(pid, 'VmRSS'):.0f}; put {mib / seconds:.0f} MiB/s")
    finally:
        c.stop()


if __name__ == "__main__":
    main()
