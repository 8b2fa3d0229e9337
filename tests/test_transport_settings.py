"""The channel settings every shardgemm channel uses (proto/transport.h
TensorChannelArguments), through the transport bench's client: a server slow
to answer a new connection (a loaded machine's, 300 ms before its first
bytes) is still reached within the call's deadline, rather than the call
failing at once with "connection attempt timed out before receiving SETTINGS
frame" (test_bench_sweep met it on a loaded 2-core machine)."""
import os
import socket
import subprocess
import threading
import time

from conftest import BIN

HOLD_S = 0.3


def copy(src, dst, hold_first_s=0.0):
    try:
        first = True
        while True:
            data = src.recv(65536)
            if not data:
                break
            if first and hold_first_s:
                time.sleep(hold_first_s)
            first = False
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def slow_answering_proxy(upstream_port):
    """A loopback proxy to `upstream_port` that holds each connection's first bytes from the server."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)

    def serve():
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", upstream_port))
            threading.Thread(target=copy, args=(client, server), daemon=True).start()
            threading.Thread(target=copy, args=(server, client, HOLD_S), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return listener


def test_a_server_slow_to_answer_a_new_connection_is_still_reached(tmp_path):
    port_file = tmp_path / "port"
    server = subprocess.Popen([os.path.join(BIN, "shardgemm-transport-bench"), "--mode=server",
                               "--listen=127.0.0.1:0", f"--port_file={port_file}"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    proxy = None
    try:
        deadline = time.time() + 30
        while not port_file.exists() and time.time() < deadline:
            time.sleep(0.02)
        proxy = slow_answering_proxy(int(port_file.read_text()))
        r = subprocess.run([os.path.join(BIN, "shardgemm-transport-bench"), "--mode=client",
                            f"--target=127.0.0.1:{proxy.getsockname()[1]}", "--in_bytes=4096", "--out_bytes=4096",
                            "--iters=2", "--warmup=0", "--call_timeout_s=10"],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "0/2 wrong" in r.stdout, r.stdout
    finally:
        if proxy is not None:
            proxy.close()
        server.terminate()
        server.wait(timeout=10)
