"""GroupedGemmResponse.phases: where a request's server time went (plan,
queue, transfer, kernel, collectives, transport, assemble), as the service
benchmark's per-phase breakdown reads it."""
import numpy as np
import pytest

rng = np.random.default_rng(17)
PHASES = ("plan_seconds", "queue_seconds", "transfer_seconds", "kernel_seconds", "collective_seconds",
          "transport_seconds", "assemble_seconds")


def _request(client, collective):
    lhs = rng.standard_normal((256, 128)).astype(np.float32)
    rhs = rng.standard_normal((4, 128, 64)).astype(np.float32)
    if collective:  # K split over fsdp: the partial outputs all-reduced
        return client.gemm_request(lhs, rhs, [64] * 4, lhs_spec="(None, fsdp)", rhs_spec="(None, fsdp, None)")
    # Rows split over fsdp, the weights replicated: no collective.
    return client.gemm_request(lhs, rhs, [32] * 8, lhs_spec="(fsdp, None)", group_sizes_spec="(fsdp,)")


@pytest.mark.parametrize("collective", [False, True])
def test_phases_add_up_to_the_server_time(cluster_factory, collective):
    c = cluster_factory(mesh="fsdp=2", workers=2)
    req = _request(c.client, collective)
    for _ in range(5):
        resp = c.client.stub.GroupedGemm(req, timeout=60)
        phases = resp.phases
        values = {name: getattr(phases, name) for name in PHASES}
        assert all(v >= 0 for v in values.values()), values
        total = sum(values.values())
        # Each phase is a difference of clock reads inside server_seconds.
        assert total <= resp.server_seconds * 1.001 + 1e-5, (values, resp.server_seconds)
        assert total >= resp.server_seconds * 0.5, (values, resp.server_seconds)
        assert phases.kernel_seconds > 0, values
        assert phases.plan_seconds > 0 and phases.transport_seconds > 0, values
        step = phases.queue_seconds + phases.transfer_seconds + phases.kernel_seconds + phases.collective_seconds
        assert step <= resp.worker_seconds + phases.queue_seconds + 1e-6, (values, resp.worker_seconds)
        if collective:
            assert phases.collective_seconds > 0, values
