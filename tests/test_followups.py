"""Stream-ordered follow-ups of the bucket reductions (issue 30 item 2, data_parallel/sync.py).

On NCCL a reduction's follow-ups (the HSDP replica all-reduce, adding into the held shard, freeing the
buffer, the offload copy) are queued right after its launch, ordered on the device by work.wait(); on gloo
the launches poll is_completed(). On CPU the NCCL behaviour is exercised with a work-handle stand-in that
never reports completion until it is waited for: the polling path then follows up nothing before
finish_grad_sync, the ordered path follows up every bucket at its launch, in bucket order, and both give
the same gradients, norms and weights (the polling run is the reference: they must be bit-identical).
"""
from __future__ import annotations

import pytest
import torch

from parallel3d import comm
from parallel3d.data_parallel import sync
from parallel3d.data_parallel.sync import GradientSync
from parallel3d.mesh import MeshSpec
from test_dp_parity import BASE, check_parity, reference, train


class NotDoneUntilWaited:
    """A work handle that is never completed for the host until someone waits for it (NCCL's view from
    the host while the GPU runs behind)."""

    def __init__(self, work) -> None:
        self.work, self.waited = work, False

    def is_completed(self) -> bool:
        return self.waited

    def wait(self) -> bool:
        if self.work is not None:
            self.work.wait()
        self.waited = True
        return True


def _run(w, zero: int, acc: int, ordered: bool, hsdp: bool):
    log: list = []
    start_rs, start_ar = sync.start_reduce_scatter, sync.start_all_reduce
    launch, follow_up = GradientSync._launch, GradientSync._follow_up
    orders = comm.orders_on_device
    sync.start_reduce_scatter = lambda *a: NotDoneUntilWaited(start_rs(*a))
    sync.start_all_reduce = lambda *a: NotDoneUntilWaited(start_ar(*a))
    GradientSync._launch = lambda self, b: (log.append(("launch", self.buckets.index(b))), launch(self, b))[1]

    def traced(self, p):
        if not p.replicating:   # the second hop (HSDP) comes back here: log the first visit only
            log.append(("follow", self.buckets.index(p.b)))
        return follow_up(self, p)
    GradientSync._follow_up = traced
    comm.orders_on_device = lambda group: ordered
    try:
        spec = MeshSpec(dp=w.world_size, dp_shard=2) if hsdp else MeshSpec(dp=w.world_size)
        out = train(w.context(spec), BASE, zero, acc, steps=2)
    finally:
        sync.start_reduce_scatter, sync.start_all_reduce = start_rs, start_ar
        GradientSync._launch, GradientSync._follow_up = launch, follow_up
        comm.orders_on_device = orders
    return out, log


CASES = [(1, 1, False), (2, 2, False), (3, 2, False), (0, 2, False), (2, 2, True)]


@pytest.mark.parametrize("zero,acc,hsdp", CASES, ids=[f"zero{z}-acc{a}{'-hsdp' if h else ''}" for z, a, h in CASES])
def test_follow_ups_are_issued_at_launch_in_bucket_order(worlds, zero, acc, hsdp):
    world = 4 if hsdp else 2
    polled = worlds.run(world, _run, zero, acc, False, hsdp)
    ordered = worlds.run(world, _run, zero, acc, True, hsdp)
    for (ref, ref_log), (got, log) in zip(polled, ordered):
        # ordered: every launch is followed up at once, so launches and follow-ups alternate
        launched = [k for _, k in log[0::2]]
        assert log and log[0::2] == [("launch", k) for k in launched], log
        assert log[1::2] == [("follow", k) for k in launched], log
        # polled with handles that never complete for the host: nothing is followed up before the end
        first_follow = next(i for i, e in enumerate(ref_log) if e[0] == "follow")
        assert all(e[0] == "launch" for e in ref_log[:first_follow]) and first_follow > 1
        assert [e for e in ref_log if e[0] == "launch"] == [e for e in log if e[0] == "launch"]
        assert got["losses"] == ref["losses"] and got["norms"] == ref["norms"]
        for name, (t, sl, shape) in ref["grads"].items():
            assert torch.equal(got["grads"][name][0], t), name
        for name, (t, sl, shape) in ref["weights"].items():
            assert torch.equal(got["weights"][name][0], t), name


def _nccl(w, zero: int, acc: int):
    ctx = w.context(MeshSpec(dp=w.world_size))
    assert comm.orders_on_device(ctx.dp_cp), "NCCL orders follow-ups on the device"
    return train(ctx, BASE, zero, acc)


@pytest.mark.gpu
@pytest.mark.multigpu
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_nccl_follow_ups_are_stream_ordered_and_exact(worlds, zero):
    """Two GPUs over NCCL: the ordered path (side stream, no host polls) equals world size 1."""
    check_parity(worlds.run(2, _nccl, zero, 2), reference(BASE))
