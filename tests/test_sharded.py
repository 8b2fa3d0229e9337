"""Sharded execution on real worker processes (CPU backend, Gloo collectives)
against the single-worker per-shard reference."""
import threading
import time

import grpc
import numpy as np
import pytest

from reference import assert_close
from shardgemm_client import pb

rng = np.random.default_rng(11)


def rand(*shape):
    return rng.uniform(-1, 1, size=shape).astype(np.float32)


def per_shard_reference(lhs, rhs, sizes, plan, bias=None, rhs_transposed=False, ragged_k=False):
    """Each row shard is its own ragged array over the groups its plan entry
    names; ragged-K partial sums over row shards add up."""
    shards = sorted({(w.group_sizes_begin, w.group_sizes_end, w.first_group) for w in plan.workers})
    rows = lhs.shape[0] // len(shards)
    lhs64 = lhs.astype(np.float64)
    rhs64 = rhs.astype(np.float64)
    if ragged_k:
        groups = max(first + end - begin for begin, end, first in shards)
        out = np.zeros((groups, lhs.shape[1], rhs.shape[1]))
    else:
        w = rhs64.transpose(0, 2, 1) if rhs_transposed else rhs64
        out = np.zeros((lhs.shape[0], w.shape[2]))
    for s, (begin, end, first) in enumerate(shards):
        row = s * rows
        for j, size in enumerate(sizes[begin:end]):
            g = first + j
            a = lhs64[row:row + size]
            if ragged_k:
                out[g] += a.T @ rhs64[row:row + size]
            else:
                out[row:row + size] = a @ w[g] + (0 if bias is None else bias[g])
            row += size
    return out


def uneven_sizes(num_shards, groups_per_shard, rows_per_shard):
    sizes = []
    for _ in range(num_shards):
        cut = np.sort(rng.integers(0, rows_per_shard + 1, size=groups_per_shard))
        local = np.diff(np.concatenate([[0], cut])).tolist()
        if groups_per_shard > 1:
            local[rng.integers(groups_per_shard)] = 0  # an empty group
        sizes += [int(x) for x in local]
    return sizes


# (name, mesh, workers, M, K, N, G, lhs_spec, rhs_spec, gs_spec, out_spec, row_shards, groups_per_shard, options)
CASES = [
    ("dp", "dp=2", 2, 64, 32, 16, 4, "(dp, None)", "", "(dp,)", "", 2, 4, {}),
    ("fsdp_gather_weight", "fsdp=2", 2, 64, 32, 16, 4, "(fsdp, None)", "(None, fsdp, None)", "(fsdp,)", "", 2, 4, {}),
    ("ep", "ep=2", 2, 64, 32, 16, 4, "(ep, None)", "(ep, None, None)", "(ep,)", "", 2, 2, {}),
    ("ep_injected", "ep=4", 4, 128, 32, 16, 8, "(ep, None)", "", "(ep,)", "", 4, 2, {}),
    ("dp_x_ep", "dp=2,ep=2", 4, 128, 32, 16, 4, "((dp, ep), None)", "(ep, None, None)", "((dp, ep),)", "", 4, 2, {}),
    ("fsdp_x_ep_nested", "fsdp=2,ep=2", 4, 128, 32, 16, 4, "((fsdp, ep), None)", "(ep, fsdp, None)", "((fsdp, ep),)", "", 4, 2, {}),
    ("nested_ep_major", "fsdp=2,ep=2", 4, 128, 32, 16, 4, "((ep, fsdp), None)", "(ep, None, None)", "((ep, fsdp),)", "", 4, 2, {}),
    ("tp_column", "tp=2", 2, 64, 32, 16, 4, "", "(None, None, tp)", "", "", 1, 4, {}),
    ("tp_row_allreduce", "tp=2", 2, 64, 32, 16, 4, "(None, tp)", "(None, tp, None)", "", "", 1, 4, {}),
    ("tp_row_reduce_scatter", "tp=2", 2, 64, 32, 16, 4, "(None, tp)", "(None, tp, None)", "", "(None, tp)", 1, 4, {}),
    ("dp_x_tp_transposed_bias", "dp=2,tp=2", 4, 64, 32, 16, 4, "(dp, None)", "(None, tp, None)", "(dp,)", "", 2, 4,
     {"rhs_transposed": True, "bias": True}),
    ("eight_workers", "dp=2,fsdp=2,ep=2", 8, 256, 32, 16, 4, "((dp, fsdp, ep), None)", "(ep, fsdp, None)",
     "((dp, fsdp, ep),)", "", 8, 2, {}),
    ("te_compat_drops_tp", "dp=2,tp=2", 4, 64, 32, 16, 4, "(dp, tp)", "(None, tp, None)", "(dp,)", "", 2, 4,
     {"compat": "te"}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_ragged_m_sharded_equals_reference(cluster_factory, case):
    name, mesh, workers, m, k, n, g, lhs_spec, rhs_spec, gs_spec, out_spec, shards, gps, opts = case
    c = cluster_factory(mesh=mesh, workers=workers).client
    sizes = uneven_sizes(shards, gps, m // shards)
    transposed = opts.get("rhs_transposed", False)
    lhs, rhs = rand(m, k), (rand(g, n, k) if transposed else rand(g, k, n))
    bias = rand(g, n) if opts.get("bias") else None
    out, plan = c.grouped_gemm(lhs, rhs, sizes, bias, rhs_transposed=transposed, lhs_spec=lhs_spec,
                               rhs_spec=rhs_spec, group_sizes_spec=gs_spec, out_spec=out_spec,
                               compat=opts.get("compat", "default"), include_plan=True)
    ref = per_shard_reference(lhs, rhs, sizes, plan, bias, transposed)
    assert_close(out, ref, k)
    kinds = [pb.CollectiveKind.Name(cc.kind) for cc in plan.collectives]
    if name == "fsdp_gather_weight":
        assert "COLLECTIVE_ALL_GATHER" in kinds
    if name.startswith("ep"):
        # Each EP worker owns its own experts: rank r (its ep coordinate) reads experts r*G/ep...
        per_worker = g // workers
        assert [w.first_group for w in plan.workers] == [r * per_worker for r in range(workers)]
    if name == "tp_row_allreduce":
        assert "COLLECTIVE_ALL_REDUCE_SUM" in kinds
    if name == "tp_row_reduce_scatter":
        assert "COLLECTIVE_REDUCE_SCATTER" in kinds and plan.out_spec.replace(" ", "") == "(None,tp)"
    if name == "te_compat_drops_tp":
        assert any("tp" in w for w in plan.warnings)


def test_row_split_is_bit_identical_to_one_worker(cluster_factory):
    """Splitting rows (dp/fsdp/ep) does not change any row's summation order."""
    lhs, rhs = rand(128, 48), rand(4, 48, 24)
    sizes = uneven_sizes(4, 2, 32)
    sharded = cluster_factory(mesh="fsdp=2,ep=2", workers=4).client
    out, plan = sharded.grouped_gemm(lhs, rhs, sizes, lhs_spec="((fsdp, ep), None)",
                                     rhs_spec="(ep, None, None)", group_sizes_spec="((fsdp, ep),)",
                                     include_plan=True)
    single = cluster_factory().client
    for s, w in enumerate(sorted({(w.group_sizes_begin, w.first_group) for w in plan.workers})):
        begin, first = w
        rows = slice(32 * s, 32 * (s + 1))
        ref, _ = single.grouped_gemm(lhs[rows], rhs[first:first + 2], sizes[begin:begin + 2])
        assert np.array_equal(out[rows], ref), f"row shard {s} differs"


def test_wgrad_partial_sums_reduced_and_scattered(cluster_factory):
    c = cluster_factory(mesh="fsdp=2", workers=2).client
    m, k, n, g = 64, 16, 8, 4
    lhs, rhs = rand(m, k), rand(m, n)
    sizes = uneven_sizes(2, g, m // 2)
    for out_spec in ["", "(None, fsdp, None)"]:
        out, plan = c.grouped_gemm(lhs, rhs, sizes, ragged_k=True, lhs_spec="(fsdp, None)",
                                   rhs_spec="(fsdp, None)", group_sizes_spec="(fsdp,)",
                                   out_spec=out_spec, include_plan=True)
        assert out.shape == (g, k, n)
        assert_close(out, per_shard_reference(lhs, rhs, sizes, plan, ragged_k=True), m)
        kinds = [pb.CollectiveKind.Name(cc.kind) for cc in plan.collectives]
        assert ("COLLECTIVE_REDUCE_SCATTER" if out_spec else "COLLECTIVE_ALL_REDUCE_SUM") in kinds, kinds


def test_resident_weights_gathered_along_fsdp(cluster_factory):
    c = cluster_factory(mesh="fsdp=2,ep=2", workers=4).client
    w = rand(4, 32, 16)
    c.put("experts", w, spec="(ep, fsdp, None)")
    assert np.array_equal(c.get("experts"), w)
    lhs = rand(128, 32)
    sizes = uneven_sizes(4, 2, 32)
    out, plan = c.grouped_gemm(lhs, "experts", sizes, lhs_spec="((fsdp, ep), None)",
                               group_sizes_spec="((fsdp, ep),)", include_plan=True)
    assert [(cc.kind, cc.tensor, list(cc.axes)) for cc in plan.collectives] == [
        (pb.COLLECTIVE_ALL_GATHER, pb.TENSOR_RHS, ["fsdp"])]
    assert_close(out, per_shard_reference(lhs, w, sizes, plan), 32)
    # Output kept resident with its sharding, then read back assembled.
    c.grouped_gemm(lhs, "experts", sizes, lhs_spec="((fsdp, ep), None)",
                   group_sizes_spec="((fsdp, ep),)", keep_output_as="y")
    assert np.array_equal(c.get("y"), out)


def test_memory_budget_fails_the_request_everywhere_and_keeps_what_is_resident(cluster_factory):
    cl = cluster_factory(mesh="dp=2", workers=2, worker_flags=("--memory_budget_mb=1",))
    c = cl.client
    small = rand(2, 16, 16)
    c.put("small", small)
    with pytest.raises(grpc.RpcError) as e:
        c.put("huge", rand(1024, 512))  # 2 MiB replicated on each worker: over budget
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as e:
        c.grouped_gemm(rand(1024, 256), rand(2, 256, 256), [256, 256, 256, 256], lhs_spec="(dp, None)",
                       group_sizes_spec="(dp,)")
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value.details()
    assert np.array_equal(c.get("small"), small)
    assert [t.name for t in c.list()] == ["small"]
    # The mesh still runs collectives for the next request.
    lhs, sizes = rand(32, 16), [8, 8, 8, 8]
    out, plan = c.grouped_gemm(lhs, "small", sizes, lhs_spec="(dp, None)", group_sizes_spec="(dp,)",
                               include_plan=True)
    assert_close(out, per_shard_reference(lhs, small, sizes, plan), 16)
    assert cl.alive()


def test_failure_on_one_worker_fails_the_request_and_the_mesh_stays_usable(cluster_factory):
    cl = cluster_factory(mesh="fsdp=2", workers=2)
    c = cl.client
    w = rand(2, 16, 8)
    c.put("w", w, spec="(None, fsdp, None)")
    # Concurrently delete the weight while requests that gather it are queued:
    # some requests fail NOT_FOUND on every worker, none hang.
    lhs, sizes = rand(32, 16), [8, 8, 8, 8]
    errors = []

    def use():
        try:
            c.grouped_gemm(lhs, "w", sizes, lhs_spec="(fsdp, None)", group_sizes_spec="(fsdp,)")
        except grpc.RpcError as e:
            errors.append(e.code())

    threads = [threading.Thread(target=use) for _ in range(6)]
    for t in threads:
        t.start()
    c.delete("w")
    for t in threads:
        t.join(timeout=60)
    assert all(code == grpc.StatusCode.NOT_FOUND for code in errors), errors
    c.put("w", w, spec="(None, fsdp, None)")
    out, plan = c.grouped_gemm(lhs, "w", sizes, lhs_spec="(fsdp, None)", group_sizes_spec="(fsdp,)",
                               include_plan=True)
    assert_close(out, per_shard_reference(lhs, w, sizes, plan), 16)


def test_sixteen_clients_mixed_requests(cluster_factory):
    from shardgemm_client import Client
    cl = cluster_factory(mesh="fsdp=2,ep=2", workers=4)
    cl.client.put("experts", rand(4, 32, 16), spec="(ep, fsdp, None)")
    w = cl.client.get("experts")
    requests_per_client = 100
    failures = []

    def client_loop(i):
        local = np.random.default_rng(i)
        c = Client(cl.address, timeout=120, tls_dir=cl.tls_dir)
        try:
            for j in range(requests_per_client):
                kind = (i + j) % 3
                lhs = local.uniform(-1, 1, size=(128, 32)).astype(np.float32)
                sizes = [8, 8, 16, 0, 4, 4, 30, 2]
                if kind == 0:  # resident experts, FSDP gather + EP
                    out, plan = c.grouped_gemm(lhs, "experts", sizes, lhs_spec="((fsdp, ep), None)",
                                               group_sizes_spec="((fsdp, ep),)", include_plan=True)
                    ref = per_shard_reference(lhs, w, sizes, plan)
                elif kind == 1:  # inline weights, K split over fsdp (all-reduce)
                    rhs = local.uniform(-1, 1, size=(4, 32, 16)).astype(np.float32)
                    out, plan = c.grouped_gemm(lhs, rhs, sizes[:4] * 1, lhs_spec="(None, fsdp)",
                                               rhs_spec="(None, fsdp, None)", include_plan=True)
                    ref = per_shard_reference(lhs, rhs, sizes[:4], plan)
                else:  # wgrad
                    rhs = local.uniform(-1, 1, size=(128, 8)).astype(np.float32)
                    out, plan = c.grouped_gemm(lhs, rhs, sizes, ragged_k=True, lhs_spec="((fsdp, ep), None)",
                                               rhs_spec="((fsdp, ep), None)", group_sizes_spec="((fsdp, ep),)",
                                               include_plan=True)
                    ref = per_shard_reference(lhs, rhs, sizes, plan, ragged_k=True)
                assert_close(out, ref, 128)
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(f"client {i}: {e!r}"[:500])
        finally:
            c.close()

    start = time.time()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a client is stuck"
    assert not failures, failures[:3]
    assert time.time() - start < 300


@pytest.mark.parametrize("mesh, workers, lhs_spec, rhs_spec", [
    ("fsdp=2,ep=2", 4, "((fsdp, ep), None)", "(ep, fsdp, None)"),
    ("dp=2", 2, "(dp, None)", ""),
    ("ep=4", 4, "(ep, None)", "(ep, None, None)"),
])
def test_global_sorted_layout_equals_the_unsharded_grouped_gemm(cluster_factory, mesh, workers, lhs_spec, rhs_spec):
    """Client-friendly layout: rows sorted by group with global group sizes,
    routed to the experts' owners by the coordinator, returned in order."""
    from reference import grouped_gemm_ragged_k, grouped_gemm_ragged_m
    c = cluster_factory(mesh=mesh, workers=workers).client
    sizes = [37, 0, 5, 60, 1, 22, 0, 9]
    m = sum(sizes) + 6  # a few padding rows
    lhs, rhs = rand(m, 32), rand(8, 32, 16)
    out, _ = c.grouped_gemm(lhs, rhs, sizes, lhs_spec=lhs_spec, rhs_spec=rhs_spec, global_sorted=True)
    assert out.shape == (m, 16)
    assert_close(out, grouped_gemm_ragged_m(lhs, rhs, sizes), 32)
    assert np.all(out[sum(sizes):] == 0)
    grad = rand(m, 16)
    wgrad, _ = c.grouped_gemm(lhs, grad, sizes, ragged_k=True, lhs_spec=lhs_spec, rhs_spec=lhs_spec,
                              global_sorted=True)
    assert_close(wgrad, grouped_gemm_ragged_k(lhs, grad, sizes), m)


def test_overwriting_a_resident_tensor_never_fails_requests_using_it(cluster_factory):
    """A replaced generation leaves the workers only after the requests that
    resolved it are done: concurrent users see the old or the new weights."""
    cl = cluster_factory(mesh="fsdp=2", workers=2)
    c = cl.client
    versions = [rand(2, 16, 8) for _ in range(4)]
    c.put("w", versions[0], spec="(None, fsdp, None)")
    lhs, sizes = rand(32, 16), [8, 8, 8, 8]
    refs = []
    for v in versions:
        out, plan = c.grouped_gemm(lhs, v, sizes, lhs_spec="(fsdp, None)", group_sizes_spec="(fsdp,)",
                                   include_plan=True)
        refs.append(out)
    failures = []

    def use():
        for _ in range(15):
            try:
                out, _ = c.grouped_gemm(lhs, "w", sizes, lhs_spec="(fsdp, None)", group_sizes_spec="(fsdp,)")
                if not any(np.array_equal(out, r) for r in refs):
                    failures.append("result matches no version")
            except grpc.RpcError as e:
                failures.append(f"{e.code()}: {e.details()}")

    threads = [threading.Thread(target=use) for _ in range(6)]
    for t in threads:
        t.start()
    for v in versions[1:] * 3:
        c.put("w", v, spec="(None, fsdp, None)", overwrite=True)
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures[:3]
    c.delete("w")
    assert c.list() == []
