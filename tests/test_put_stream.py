"""An inline PutTensor whose blocks are ranges of the row-major bytes (a spec
splitting only dim 0, or replicated) streams through the coordinator to the
workers' staging areas as its chunks arrive (docs/architecture.md, "The
inline path"): the tensor is stored right, the coordinator's high-water mark
grows by far less than the payload, and a put that fails (the client goes
away, a wrong size, a worker dies mid-stream) registers nothing, leaves
nothing staged and loses nothing resident."""
import os
import signal
import threading
import time

import grpc
import numpy as np
import pytest

from shardgemm_client import pb, pb_grpc

CHUNK = 1 << 20
rng = np.random.default_rng(18)


def vm_hwm_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise KeyError("VmHWM")


def staged_bytes(cluster, ranks=None):
    """Each worker's staged bytes (Worker.Status: a plaintext mesh answers anyone)."""
    held = []
    for w in cluster.client.cluster_info().workers:
        if ranks is not None and w.rank not in ranks:
            continue
        with grpc.insecure_channel(w.address) as ch:
            held.append(pb_grpc.WorkerStub(ch).Status(pb.WorkerStatusRequest(), timeout=10).staged_bytes)
    return held


def wait_unstaged(cluster, ranks=None, within=5.0):
    """Nothing staged on the workers, well before --staged_block_ttl (60 s)."""
    deadline = time.time() + within
    while any(staged_bytes(cluster, ranks)) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(staged_bytes(cluster, ranks))


def chunks(name, a, spec, overwrite=True, pause_at=None, resume=None, go_away=False):
    """PutTensor's stream for `a` (float32), 1 MiB pieces; waits on `resume`
    before the piece at byte `pause_at`, then raises there (the client goes
    away) with `go_away`."""
    raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    dtype = pb.F32
    for offset in range(0, raw.nbytes, CHUNK):
        if pause_at is not None and offset >= pause_at and not resume.is_set():
            assert resume.wait(20)
            if go_away:
                raise ConnectionError("the client went away")
        piece = raw[offset:offset + CHUNK].tobytes()
        if offset == 0:
            yield pb.TensorChunk(name=name, dtype=dtype, shape=list(a.shape), spec=spec, data=piece,
                                 overwrite=overwrite)
        else:
            yield pb.TensorChunk(data=piece)


def put_in_background(cluster, stream, errors, timeout=20):
    with grpc.insecure_channel(cluster.address) as ch:
        try:
            pb_grpc.ShardGemmStub(ch).PutTensor(stream, timeout=timeout)
        except grpc.RpcError as e:
            errors.append(e)


def wait_reserved(cluster, by_rank, within=10.0):
    """Until each rank's staging area holds (has reserved) by_rank[rank] bytes."""
    ranks = sorted(by_rank)
    want = [by_rank[r] for r in ranks]
    deadline = time.time() + within
    while staged_bytes(cluster, set(ranks)) != want and time.time() < deadline:
        time.sleep(0.02)
    assert staged_bytes(cluster, set(ranks)) == want


def resident(cluster, name):
    return {t.name: t for t in cluster.client.list()}.get(name)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    from conftest import Cluster
    c = Cluster(tmp_path_factory.mktemp("dp2"), mesh="dp=2", workers=2)
    yield c
    c.stop()


@pytest.mark.parametrize("spec,shape", [("(dp, None)", (384, 2048 + 3 * 2)), ("", (384, 2048 + 3 * 2)),
                                        ("(None, dp)", (384, 2048 + 3 * 2)), ("(None, dp, None)", (24, 6, 4096 + 2)),
                                        ("(None, dp)", (3 << 17, 2))],
                         ids=["rows", "replicated", "columns", "middle_dim", "one_element_runs"])
def test_put_is_stored_right_and_read_back(dp2, spec, shape):
    a = rng.standard_normal(shape, dtype=np.float32)  # 3 MiB and a bit: pieces straddle the blocks and the rows
    dp2.client.put("w", a, spec=spec, overwrite=True)
    np.testing.assert_array_equal(dp2.client.get("w"), a)
    info = resident(dp2, "w")
    assert list(info.shape) == list(a.shape)
    wait_unstaged(dp2, within=0)


# A column split streams too: each chunk's runs of a block go on as one message.
@pytest.mark.parametrize("spec", ["(dp, None)", "(None, dp)"], ids=["rows", "columns"])
def test_the_coordinators_high_water_mark_grows_by_far_less_than_the_payload(dp2, spec):
    a = rng.standard_normal((96 << 10, 256), dtype=np.float32)  # 96 MiB
    before = vm_hwm_kib(dp2.coordinator.pid)
    dp2.client.put("big", a, spec=spec, overwrite=True)
    grown = vm_hwm_kib(dp2.coordinator.pid) - before
    assert grown * 1024 < a.nbytes / 2, f"the coordinator's VmHWM grew {grown} KiB for a {a.nbytes >> 20} MiB put"
    half = a.shape[0] // 2
    got = dp2.client.get("big")
    assert np.array_equal(got[:1024], a[:1024]) and np.array_equal(got[half - 1:half + 1], a[half - 1:half + 1])
    assert np.array_equal(got[-1024:], a[-1024:])
    dp2.client.delete("big")


def test_standby_copies_stream_to_their_holders_with_the_blocks(cluster_factory):
    c = cluster_factory(mesh="dp=2", workers=2, coordinator_flags=("--replicas=2",))
    a = rng.standard_normal((1024, 1024), dtype=np.float32)  # 4 MiB
    resume = threading.Event()
    errors = []
    t = threading.Thread(target=put_in_background, args=(c, chunks("w", a, "(dp, None)", pause_at=3 * CHUNK,
                                                                    resume=resume), errors))
    t.start()
    wait_reserved(c, {0: a.nbytes, 1: a.nbytes})  # each rank: its own block and the other's standby copy
    resume.set()
    t.join(30)
    assert not t.is_alive() and not errors, errors
    np.testing.assert_array_equal(c.client.get("w"), a)
    assert sum(w.standby_bytes for w in c.client.cluster_info().workers) == a.nbytes
    wait_unstaged(c, within=0)


def test_a_client_that_goes_away_mid_put_keeps_the_old_generation(dp2):
    old = rng.standard_normal((256, 1024), dtype=np.float32)
    dp2.client.put("kept", old, spec="(dp, None)", overwrite=True)
    new = rng.standard_normal((1024, 1024), dtype=np.float32)  # 4 MiB: it goes away in rank 1's block
    resume = threading.Event()
    errors = []
    t = threading.Thread(target=put_in_background, args=(dp2, chunks("kept", new, "(dp, None)", pause_at=3 * CHUNK,
                                                                      resume=resume, go_away=True), errors))
    t.start()
    wait_reserved(dp2, {0: new.nbytes // 2, 1: new.nbytes // 2})  # both streams are open
    resume.set()
    t.join(30)
    assert not t.is_alive() and len(errors) == 1, errors
    assert errors[0].code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN)
    wait_unstaged(dp2)
    assert list(resident(dp2, "kept").shape) == [256, 1024]
    np.testing.assert_array_equal(dp2.client.get("kept"), old)


@pytest.mark.parametrize("short", [True, False], ids=["too_few_bytes", "too_many_bytes"])
def test_a_wrong_total_size_is_invalid_argument_naming_the_bytes(dp2, short):
    old = rng.standard_normal((64, 1024), dtype=np.float32)
    dp2.client.put("sized", old, spec="(dp, None)", overwrite=True)
    a = rng.standard_normal((512, 1024), dtype=np.float32)

    def lying():
        for i, c in enumerate(chunks("sized", a, "(dp, None)")):
            if i == 0:
                c.shape[:] = [640 if not short else 384, 1024]  # the header claims more rows / fewer rows
            yield c

    with grpc.insecure_channel(dp2.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.ShardGemmStub(ch).PutTensor(lying(), timeout=20)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "data: tensor 'sized'" in e.value.details() and "bytes, the chunks carry" in e.value.details()
    wait_unstaged(dp2)
    assert list(resident(dp2, "sized").shape) == [64, 1024]
    np.testing.assert_array_equal(dp2.client.get("sized"), old)


def test_a_worker_that_dies_mid_stream_fails_the_put_naming_its_rank(cluster_factory):
    c = cluster_factory(mesh="dp=2", workers=2)
    old = rng.standard_normal((256, 1024), dtype=np.float32)
    c.client.put("w", old, spec="(dp, None)", overwrite=True)
    new = rng.standard_normal((1024, 1024), dtype=np.float32)  # 4 MiB: rank 1's block is the second half
    rank1 = [w for w in c.client.cluster_info().workers if w.rank == 1][0]
    resume = threading.Event()
    errors = []
    t = threading.Thread(target=put_in_background, args=(c, chunks("w", new, "(dp, None)", pause_at=3 * CHUNK,
                                                                    resume=resume), errors))
    t.start()
    wait_reserved(c, {0: new.nbytes // 2, 1: new.nbytes // 2})  # both streams are open
    pid = worker_pid(c, rank1.address)
    os.kill(pid, signal.SIGKILL)
    resume.set()
    t.join(30)
    assert not t.is_alive() and len(errors) == 1, errors
    e = errors[0]
    assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL), e
    assert "worker rank 1" in e.details(), e.details()
    wait_unstaged(c, ranks={0})
    # Nothing registered: the old generation is still the tensor.
    assert list(resident(c, "w").shape) == [256, 1024]


def worker_pid(cluster, address):
    """The pid of the worker serving `address` (its log names the address it serves).

    A worker's "serving" line follows its registration: it is waited for, within a bound."""
    deadline = time.time() + 10
    while True:
        for name, p in cluster.procs:
            if not name.startswith("worker"):
                continue
            with open(os.path.join(cluster.logs, f"{name}.log")) as f:
                if address in f.read():
                    return p.pid
        if time.time() > deadline:
            raise LookupError(address)
        time.sleep(0.05)


def test_a_worker_that_stalls_mid_stream_fails_the_put_at_its_deadline(cluster_factory):
    c = cluster_factory(mesh="dp=2", workers=2)
    old = rng.standard_normal((256, 1024), dtype=np.float32)
    c.client.put("w", old, spec="(dp, None)", overwrite=True)
    new = rng.standard_normal((8192, 1024), dtype=np.float32)  # 32 MiB: rank 1's half outgrows the transport's buffers
    rank1 = [w for w in c.client.cluster_info().workers if w.rank == 1][0]
    pid = worker_pid(c, rank1.address)
    resume = threading.Event()
    errors = []
    stream = chunks("w", new, "(dp, None)", pause_at=new.nbytes // 2, resume=resume)
    start = time.time()
    t = threading.Thread(target=lambda: put_in_background(c, stream, errors, timeout=3))
    t.start()
    wait_reserved(c, {0: new.nbytes // 2, 1: new.nbytes // 2})
    os.kill(pid, signal.SIGSTOP)
    try:
        resume.set()
        t.join(15)
        assert not t.is_alive() and len(errors) == 1, errors
        assert errors[0].code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.time() - start < 8
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_unstaged(c)
    deadline = time.time() + 20
    while not c.client.cluster_info().ready and time.time() < deadline:
        time.sleep(0.1)
    assert list(resident(c, "w").shape) == [256, 1024]
    np.testing.assert_array_equal(c.client.get("w"), old)


def test_a_put_meeting_a_full_staging_area_takes_the_assembled_path(cluster_factory):
    # Each worker stages at most 4 MiB; a first put's streams reserve 3 MiB on each while its client pauses.
    c = cluster_factory(mesh="dp=2", workers=2, worker_flags=(f"--staging_budget={4 << 20}",))
    first = rng.standard_normal((1536, 1024), dtype=np.float32)  # 6 MiB: 3 MiB a rank
    resume = threading.Event()
    errors = []
    t = threading.Thread(target=put_in_background, args=(c, chunks("first", first, "(dp, None)", pause_at=2 * CHUNK,
                                                                    resume=resume), errors))
    t.start()
    try:
        wait_reserved(c, {0: first.nbytes // 2, 1: first.nbytes // 2})
        second = rng.standard_normal((1024, 1024), dtype=np.float32)  # 2 MiB a rank: more than is left
        c.client.put("second", second, spec="(dp, None)", path="inline")
        np.testing.assert_array_equal(c.client.get("second", path="inline"), second)
        # The direct path has no assembled fallback: the worker's refusal names the put's tensor and rank
        # (a put's ticket has no role: it read "staging the TENSOR_ROLE_UNSPECIFIED block").
        with pytest.raises(grpc.RpcError) as refused:
            c.client.put("third", second, spec="(dp, None)", path="direct")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        assert "staging the block of tensor 'third' for rank " in refused.value.details(), refused.value.details()
        assert "TENSOR_ROLE_UNSPECIFIED" not in refused.value.details()
    finally:
        resume.set()
        t.join(30)
    assert not t.is_alive() and not errors, errors
    np.testing.assert_array_equal(c.client.get("first", path="inline"), first)
    wait_unstaged(c)


def test_a_put_whose_client_pauses_longer_than_the_ttl_between_chunks_is_stored(cluster_factory):
    # A streamed put is bounded by progress, not length: each chunk restarts its blocks' TTL on the workers
    # and the coordinator's wait for the next one. 2 s TTL; two pauses of 3.5 s; 7 s in all (more than the TTL
    # three times over), once NOT_FOUND "expired while it was being staged".
    c = cluster_factory(mesh="dp=2", workers=2, worker_flags=("--staged_block_ttl=2s",),
                        coordinator_flags=("--step_timeout=5s",))
    a = rng.standard_normal((1024, 1024), dtype=np.float32)  # 4 MiB: 4 chunks, 2 MiB a rank

    def slow():
        for i, chunk in enumerate(chunks("slow", a, "(dp, None)")):
            if i in (1, 3):
                time.sleep(3.5)
            yield chunk

    start = time.time()
    with grpc.insecure_channel(c.address) as ch:
        pb_grpc.ShardGemmStub(ch).PutTensor(slow(), timeout=60)
    assert time.time() - start > 7
    assert list(resident(c, "slow").shape) == [1024, 1024]
    np.testing.assert_array_equal(c.client.get("slow", path="inline"), a)
    wait_unstaged(c)


def test_a_client_that_stalls_mid_put_without_a_deadline_frees_the_name_at_the_step_timeout(cluster_factory):
    # A put that waited --step_timeout for its client's next chunk cannot go on: its call ends then and its
    # claim on the name goes (a client with no deadline held it for as long as it stalled).
    c = cluster_factory(mesh="dp=2", workers=2, coordinator_flags=("--step_timeout=2s",))
    a = rng.standard_normal((1024, 1024), dtype=np.float32)  # 4 MiB
    resume = threading.Event()
    errors = []
    start = time.time()
    t = threading.Thread(target=put_in_background, args=(c, chunks("stalled", a, "(dp, None)", pause_at=CHUNK,
                                                                    resume=resume), errors),
                         kwargs={"timeout": None})
    t.start()
    try:
        t.join(8)
        assert not t.is_alive(), "the stalled put's call is still open"
        assert len(errors) == 1 and errors[0].code() in (grpc.StatusCode.CANCELLED,
                                                         grpc.StatusCode.DEADLINE_EXCEEDED), errors
        assert 2 <= time.time() - start < 8
        assert resident(c, "stalled") is None
        c.client.put("stalled", a, spec="(dp, None)", overwrite=False, path="inline")  # the name is free
        np.testing.assert_array_equal(c.client.get("stalled", path="inline"), a)
    finally:
        resume.set()
        t.join(30)
    wait_unstaged(c)
