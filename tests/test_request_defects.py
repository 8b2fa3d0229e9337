"""End to end over real processes: one test per request defect fixed today,
each of which failed before its fix. Small shapes, 1-2 CPU workers, every RPC
with a timeout."""
import grpc
import ml_dtypes
import numpy as np
import pytest

import reference
from reference import assert_close, grouped_gemm_ragged_m
from shardgemm_client import from_tensor, pb, to_tensor

rng = np.random.default_rng(11)
TIMEOUT = 30  # seconds, for every raw stub call


def rand(*shape, dtype=np.float32):
    return rng.uniform(-1, 1, size=shape).astype(dtype)


def rpc_error(call, *args):
    with pytest.raises(grpc.RpcError) as e:
        call(*args, timeout=TIMEOUT)
    return e.value


def quantize(client, x, sizes, flatten_axis):
    req = pb.GroupedQuantizeRequest(
        x=to_tensor(x), group_sizes=to_tensor(np.asarray(sizes, np.int64)), out_dtype=pb.F8E4M3,
        scaling=pb.CURRENT, rowwise=True, flatten_axis=flatten_axis)
    return client.stub.GroupedQuantize(req, timeout=TIMEOUT)


def test_quantize_negative_flatten_axis_counts_from_the_end(cluster):
    c = cluster.client
    x = (rng.standard_normal((8, 4, 16)) * 3).astype(np.float32)
    sizes = [3, 5]  # rows = 8: the dims before flatten axis 1 (= -2 for rank 3)
    neg = quantize(c, x, sizes, -2)
    pos = quantize(c, x, sizes, 1)
    assert list(neg.rowwise_data.shape) == list(pos.rowwise_data.shape)
    assert from_tensor(neg.rowwise_data).tobytes() == from_tensor(pos.rowwise_data).tobytes()
    assert np.array_equal(from_tensor(neg.scale_inv), from_tensor(pos.scale_inv))
    assert np.array_equal(from_tensor(neg.amax), from_tensor(pos.amax))
    data, scale_inv, _ = reference.quantize_current(x.reshape(8, 64), sizes, "e4m3")
    assert np.array_equal(from_tensor(neg.rowwise_data).view(np.uint8).reshape(8, 64), data)
    assert np.array_equal(from_tensor(neg.scale_inv), scale_inv)
    # 8 rows, not 32 (which flatten axis 2 would give): sizes for 32 rows are refused.
    quantize(c, x, [16, 16], 2)
    err = rpc_error(c.stub.GroupedQuantize, pb.GroupedQuantizeRequest(
        x=to_tensor(x), group_sizes=to_tensor(np.array([16, 16], np.int64)), out_dtype=pb.F8E4M3,
        scaling=pb.CURRENT, rowwise=True, flatten_axis=-2))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    for bad in (-4, 3):
        with pytest.raises(grpc.RpcError) as e:
            quantize(c, x, sizes, bad)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
        assert "flatten_axis" in e.value.details()
    assert cluster.alive()


def test_gemm_enums_outside_their_values_are_invalid_argument(cluster):
    c = cluster.client
    for field, value in [("ragged", 7), ("layout", 9), ("compat", 5)]:
        req = c.gemm_request(rand(16, 8), rand(2, 8, 4), [8, 8])
        setattr(req, field, value)  # proto3 enums are open: the wire keeps the number
        err = rpc_error(c.stub.GroupedGemm, req)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.details())
        assert err.details().startswith(field), err.details()
        err = rpc_error(c.stub.Plan, pb.PlanRequest(grouped_gemm=req))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, err.details())
        assert err.details().startswith(field), err.details()
    out, _ = c.grouped_gemm(rand(16, 8), rand(2, 8, 4), [8, 8])
    assert out.shape == (16, 4)
    assert cluster.alive()


def test_keep_output_as_onto_a_resident_name_needs_overwrite_output(cluster):
    c = cluster.client
    lhs, rhs, sizes = rand(16, 8), rand(2, 8, 4), [8, 8]
    out, _ = c.grouped_gemm(lhs, rhs, sizes, keep_output_as="y")
    assert out is None
    old = c.get("y")
    assert_close(old, grouped_gemm_ragged_m(lhs, rhs, sizes), 8)
    # Another output, of another shape, under the same name.
    lhs2, rhs2, sizes2 = rand(8, 8), rand(2, 8, 6), [4, 4]
    req = c.gemm_request(lhs2, rhs2, sizes2, keep_output_as="y")
    err = rpc_error(c.stub.GroupedGemm, req)
    assert err.code() == grpc.StatusCode.ALREADY_EXISTS, err.details()
    assert "overwrite_output" in err.details()
    kept = c.get("y")
    assert kept.shape == (16, 4) and np.array_equal(kept, old)
    assert [list(t.shape) for t in c.list()] == [[16, 4]]
    req.overwrite_output = True
    resp = c.stub.GroupedGemm(req, timeout=TIMEOUT)
    assert resp.out.resident == "y"
    new = c.get("y")
    assert new.shape == (8, 6)
    assert_close(new, grouped_gemm_ragged_m(lhs2, rhs2, sizes2), 8)
    assert [list(t.shape) for t in c.list()] == [[8, 6]]


def test_put_claiming_more_than_the_budgets_is_resource_exhausted(cluster_factory):
    # Two workers of 1 MiB each: the mesh holds at most 2 MiB, fully sharded.
    cl = cluster_factory(mesh="dp=2", workers=2, worker_flags=["--memory_budget_mb=1"])
    c = cl.client
    just_over = (2 << 20) // 4 + 1  # f32 elements: 4 bytes past the budgets together
    for shape in ([2**40, 2**20], [just_over]):
        # Only the first chunk: the claim alone must be refused, before any data.
        first = pb.TensorChunk(name="huge", dtype=pb.F32, shape=shape)
        err = rpc_error(c.stub.PutTensor, iter([first]))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (shape, err.code(), err.details())
        assert "budget" in err.details(), err.details()
    assert cl.alive()
    small = rand(4, 3)
    c.put("small", small, spec="(dp, None)")
    assert np.array_equal(c.get("small"), small)
    assert [t.name for t in c.list()] == ["small"]


def test_tp_row_parallel_bf16_all_reduce_moves_fp32_partials(cluster_factory):
    c = cluster_factory(mesh="tp=2", workers=2).client
    bf16 = ml_dtypes.bfloat16
    lhs, rhs, sizes = rand(16, 64, dtype=bf16), rand(2, 64, 32, dtype=bf16), [10, 6]
    specs = dict(lhs_spec="(None, tp)", rhs_spec="(None, tp, None)")
    fp32_partials = 16 * 32 * 4  # [M, N] in FP32; 2(p-1)/p = 1 for p = 2

    def all_reduce(plan):
        found = [x for x in plan.collectives if x.kind == pb.COLLECTIVE_ALL_REDUCE_SUM]
        assert len(found) == 1, plan.text
        return found[0]

    assert all_reduce(c.plan(lhs, rhs, sizes, **specs)).bytes_per_worker == fp32_partials
    out, plan = c.grouped_gemm(lhs, rhs, sizes, include_plan=True, **specs)
    ar = all_reduce(plan)
    assert ar.bytes_per_worker == fp32_partials and list(ar.axes) == ["tp"]
    assert out.dtype == np.dtype(bf16) and out.shape == (16, 32)
    assert_close(out, grouped_gemm_ragged_m(lhs.astype(np.float32), rhs.astype(np.float32), sizes), 64)


def _coordinator_memory_mib(cluster):
    """The coordinator's resident set and its high-water mark, MiB."""
    fields = {}
    with open(f"/proc/{cluster.coordinator.pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


@pytest.mark.parametrize("mesh,spec,peak_of_payload", [("dp=1", "()", 0.3), ("dp=2", "(dp, None)", 0.3),
                                                        ("dp=2", "(None, dp)", 0.3)],
                         ids=["replicated_streamed", "rows_streamed", "columns_streamed"])
def test_a_large_put_costs_the_coordinator_little_and_gives_it_back(
        cluster_factory, mesh, spec, peak_of_payload):
    # Was 4x the payload at the peak (the tensor, its block, the step's copy,
    # the serialized message), and all of it kept after the put and the delete.
    # Every block streams through to the workers, a column split's run by run.
    c = cluster_factory(mesh=mesh, workers=2 if mesh == "dp=2" else 1, worker_flags=["--memory_budget_mb=1024"])
    payload_mib = 128
    x = np.random.default_rng(1).standard_normal((payload_mib * 256, 1024)).astype(np.float32)
    c.client.put("warm", x[:1024], spec=spec)  # the first request's one-off allocations
    idle, _ = _coordinator_memory_mib(c)
    c.client.put("big", x, spec=spec)
    after_put, peak = _coordinator_memory_mib(c)
    np.testing.assert_array_equal(c.client.get("big"), x)
    c.client.delete("big")
    after_delete, _ = _coordinator_memory_mib(c)
    assert peak - idle <= peak_of_payload * payload_mib, (idle, peak)
    assert after_put - idle <= 32, (idle, after_put)
    assert after_delete - idle <= 32, (idle, after_delete)
