"""Shared-memory regions on a lease (RegisterSharedMemoryRequest.lease_ms,
RenewSharedMemory): the Python clients take one and renew it while they
live, so a client killed without unregistering loses its regions a lease
later (their names and their places in the tenant's limit free again),
while a live client keeps them as long as it likes."""
import asyncio
import os
import subprocess
import sys
import textwrap
import time

import grpc
import numpy as np
import pytest

import shardgemm
import shardgemm.aio
from shardgemm_client import pb
from polling import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def shm_cluster(cluster_factory):
    return cluster_factory(mesh="dp=1", workers=1, coordinator_flags=["--shared_memory"])


def _registered(stub, name):
    """Whether `name` is registered (and its lease holds), without renewing it: a
    request naming it is refused for what it is, not for the region."""
    req = pb.GroupedGemmRequest()
    req.lhs.dtype = pb.F32
    req.lhs.shape.extend([4, 4])
    req.lhs.shared_memory.region = name
    req.lhs.shared_memory.byte_size = 64
    req.rhs.resident = "no_such_weight"
    try:
        stub.GroupedGemm(req, timeout=30)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.NOT_FOUND and "lhs.shared_memory.region" in e.details():
            return False
        return True
    return True


def test_a_live_client_keeps_its_regions_past_their_lease(shm_cluster):
    with shardgemm.Client(shm_cluster.address, timeout=30, shared_memory_lease=1.0) as c, \
            shardgemm.SharedMemoryRegion(c, 4096, name="kept") as region:
        x = region.tensor(np.float32, (4, 4))
        x.array[:] = 1
        time.sleep(3.0)  # three leases: held by the renewals alone
        assert _registered(c.stub, "kept")
    with shardgemm.Client(shm_cluster.address, timeout=30) as other:
        assert not _registered(other.stub, "kept")


def test_a_killed_client_loses_its_regions_a_lease_later(shm_cluster):
    script = textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = {[os.path.join(ROOT, "client", "python"), os.path.join(ROOT, "tests")]!r}
        import shardgemm
        c = shardgemm.Client({shm_cluster.address!r}, timeout=30, shared_memory_lease=1.0)
        r = shardgemm.SharedMemoryRegion(c, 4096, name="orphan")
        print("registered", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "registered"
        with shardgemm.Client(shm_cluster.address, timeout=30) as c:
            assert _registered(c.stub, "orphan")
            time.sleep(1.5)
            assert _registered(c.stub, "orphan"), "the live client renews it"
            proc.kill()
            proc.wait(timeout=10)
            assert wait_until(lambda: not _registered(c.stub, "orphan"), 5.0), "lapsed a lease after the kill"
            # Its name is free again.
            key = "/shardgemm_lease_test_%d" % os.getpid()
            from multiprocessing import shared_memory
            shm = shared_memory.SharedMemory(create=True, size=4096, name=key[1:])
            try:
                c.register_shared_memory("orphan", key, 4096)
                c.unregister_shared_memory("orphan")
            finally:
                shm.close()
                shm.unlink()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_the_asyncio_client_renews_too(shm_cluster):
    async def main():
        async with shardgemm.aio.Client(shm_cluster.address, timeout=30, shared_memory_lease=1.0) as c:
            region = shardgemm.aio.SharedMemoryRegion(c, 4096, name="async_kept")
            await region.register()
            await asyncio.sleep(3.0)
            with shardgemm.Client(shm_cluster.address, timeout=30) as sync:
                assert _registered(sync.stub, "async_kept")
            await region.close()

    asyncio.run(main())


def test_lease_rpcs_say_what_lapsed_and_refuse_bad_leases(shm_cluster):
    with shardgemm.Client(shm_cluster.address, timeout=30, shared_memory_lease=None) as c:
        resp = c.stub.RenewSharedMemory(pb.RenewSharedMemoryRequest(names=["never"]), timeout=30)
        assert list(resp.lapsed) == ["never"]
        from multiprocessing import shared_memory
        shm = shared_memory.SharedMemory(create=True, size=4096)
        try:
            with pytest.raises(grpc.RpcError) as err:
                c.stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(
                    name="r", key="/" + shm.name, byte_size=4096, lease_ms=50), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lease_ms" in err.value.details()
            reply = c.stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(
                name="r", key="/" + shm.name, byte_size=4096, lease_ms=500), timeout=30)
            assert reply.expires_unix_ms > time.time() * 1000
            # Unrenewed (this client took no lease of its own for it): gone after 0.5 s.
            assert wait_until(lambda: not _registered(c.stub, "r"), 3.0)
            assert list(c.stub.RenewSharedMemory(pb.RenewSharedMemoryRequest(names=["r"]), timeout=30).lapsed) == ["r"]
            # Without a lease it stays.
            c.stub.RegisterSharedMemory(pb.RegisterSharedMemoryRequest(
                name="r", key="/" + shm.name, byte_size=4096), timeout=30)
            time.sleep(1.0)
            assert _registered(c.stub, "r")
            c.unregister_shared_memory("r")
        finally:
            shm.close()
            shm.unlink()
    with pytest.raises(ValueError, match="shared_memory_lease"):
        shardgemm.Client(shm_cluster.address, shared_memory_lease=0.01)
