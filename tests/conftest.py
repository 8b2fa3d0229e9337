"""Fixtures that start real coordinator and worker processes on loopback."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "bin")
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

from shardgemm_client import Client  # noqa: E402


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, timeout=30):
    """Until something listens on the port: a gRPC channel opened before then
    would sit in reconnect backoff for seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port}")


class Cluster:
    """A coordinator with `workers` workers (CPU unless `backend` says) on `mesh`."""

    def __init__(self, tmp_path, mesh="dp=1", workers=1, roles="", worker_flags=(), coordinator_flags=(),
                 tls_dir=None, backend="cpu", bin_dir=BIN, per_worker_flags=()):
        """Plaintext (--insecure) unless `tls_dir` names certificates (make_certs).
        `bin_dir` holds the servers (the worktree's ./bin unless given);
        per_worker_flags[i], where given, are worker i's own flags (--device=i)."""
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.logs = tmp_path
        self.procs = []
        security = [f"--tls_dir={tls_dir}"] if tls_dir else ["--insecure"]
        self.tls_dir = tls_dir
        cmd = [os.path.join(bin_dir, "shardgemm-coordinator"), f"--listen={self.address}", f"--mesh={mesh}",
               *security]
        if roles:
            cmd.append(f"--roles={roles}")
        cmd.extend(coordinator_flags)
        self.coordinator = self._start("coordinator", cmd)
        wait_for_port(self.port)
        for i in range(workers):
            self._start(f"worker{i}", [os.path.join(bin_dir, "shardgemm-worker"),
                                       f"--coordinator={self.address}", f"--backend={backend}",
                                       *security, *worker_flags,
                                       *(per_worker_flags[i] if i < len(per_worker_flags) else ())])
        self.client = Client(self.address, timeout=60, tls_dir=tls_dir)
        deadline = time.time() + 60  # generous: a loaded 2-core machine starts TLS meshes slowly
        while time.time() < deadline:
            try:
                # Each probe bounded on its own: one call stuck on a connection
                # attempt must not use up the whole wait.
                if self.client.cluster_info(timeout=max(0.5, min(5.0, deadline - time.time()))).ready:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("cluster did not become ready:\n" + self.log_text())

    def cli_flags(self):
        """The CLI's flags for this cluster: its address and security."""
        security = [f"--tls_dir={self.tls_dir}"] if self.tls_dir else ["--insecure"]
        return [f"--coordinator={self.address}", *security]

    def _start(self, name, cmd):
        log = open(os.path.join(self.logs, f"{name}.log"), "w")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((name, p))
        return p

    def log_text(self):
        text = []
        for name, _ in self.procs:
            with open(os.path.join(self.logs, f"{name}.log")) as f:
                text.append(f"--- {name}\n{f.read()}")
        return "\n".join(text)

    def alive(self):
        return all(p.poll() is None for _, p in self.procs)

    def stop(self):
        self.client.close()
        for _, p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for _, p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="session")
def mesh_certs(tmp_path_factory):
    """A mesh CA, certificates for 127.0.0.1 and a client token (tools/make_certs.sh), once per run."""
    d = str(tmp_path_factory.mktemp("certs") / "tls")
    subprocess.run(["bash", os.path.join(ROOT, "tools", "make_certs.sh"), d], check=True, capture_output=True,
                   timeout=60)
    return d


@pytest.fixture
def cluster_factory(tmp_path):
    made = []

    def make(**kwargs):
        c = Cluster(tmp_path, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


@pytest.fixture
def cluster(cluster_factory):
    return cluster_factory()
