"""The work-handle contract and the strict test backend (parallel3d/comm/strict.py; issue 48, defects 1-2).

NCCL's rules, which gloo hides: a started collective's output is valid only after its handle is waited
(on CUDA: the waiting stream is ordered after the one that wrote it), a process group's collectives complete
in issue order, and a host read waits for everything the stream was made to wait behind. Every comm.start_*
returns a handle (a size-1 group's copy and the blocking qgZ / compression paths too: they wrote on the
compute stream, and a side stream reading them must wait for that); the strict backend hides each output
(NaN) until its handle is waited and reports host reads that NCCL would make wait behind work in flight.
"""
from __future__ import annotations

import math

import pytest
import torch

from parallel3d import comm
from parallel3d.data_parallel import publishing, sync
from parallel3d.host_sync import read_float
from parallel3d.mesh import MeshSpec, ParallelContext
from test_sweep import PARITY, STEPS, check
from ckpt_helpers import build_trainer, context_for, make_config


def _starts(g, dtype=torch.float32):
    inp = torch.arange(4, dtype=dtype)
    rs_out, ag_out, ar = torch.empty(4, dtype=dtype), torch.empty(4, dtype=dtype), inp.clone()
    works = [comm.start_reduce_scatter(rs_out, inp, g), comm.start_all_gather(ag_out, inp, g),
             comm.start_all_reduce(ar, g)]
    return inp, works, (rs_out, ag_out, ar)


def test_every_start_returns_a_work_handle_even_on_a_size1_group():
    """Defect 1's root: a size-1 group returned None, so a follow-up on another stream had nothing to wait
    for (the expert buckets of every preset with ep == dp x cp)."""
    g = ParallelContext.single().dp
    inp, works, outs = _starts(g)
    assert all(w is not None for w in works)
    for w in works:
        comm.wait_work(w, g, "test")
    assert all(torch.equal(o, inp) for o in outs)
    with pytest.raises(comm.CollectiveError, match="no work handle"):
        comm.wait_work(None, g, "all_gather")


def test_strict_size1_outputs_are_hidden_until_waited():
    ctx = ParallelContext.single()
    ctx.stats.make_strict()
    inp, works, outs = _starts(ctx.dp)
    assert all(torch.isnan(o).all() for o in outs)           # the copy "has not happened" for a reader
    for w in works:
        comm.wait_work(w, ctx.dp, "test")
    assert all(torch.equal(o, inp) for o in outs)
    ints = torch.empty(4, dtype=torch.int64)
    work = comm.start_reduce_scatter(ints, torch.arange(4), ctx.dp)
    assert (ints == torch.iinfo(torch.int64).max).all()
    comm.wait_work(work, ctx.dp, "test")
    assert ints.tolist() == [0, 1, 2, 3]


def _strict_semantics(w):
    ctx = w.context(MeshSpec(dp=w.world_size), strict=True)
    g, r, n = ctx.dp, w.rank, w.world_size
    t = torch.full((3,), float(r + 1))
    first = comm.start_all_reduce(t, g)
    assert torch.isnan(t).all()
    full = torch.zeros(n * 2)
    own = full[2 * r: 2 * r + 2]
    own.fill_(r + 10.0)
    second = comm.start_all_gather(full, own, g)             # in place: the own block stays readable
    kept = full.view(n, 2)
    assert (kept[r] == r + 10.0).all() and all(torch.isnan(kept[j]).all() for j in range(n) if j != r)
    comm.wait_work(second, g, "all_gather")                   # out of issue order: completes the first
    assert first.done and torch.isnan(t).all()                # ... whose output stays hidden until its wait
    read_float(torch.ones(1), ctx.stats.syncs, "step")        # the stream waits behind the all-reduce
    comm.wait_work(first, g, "all_reduce")
    assert (t == n * (n + 1) / 2).all()
    assert full.view(n, 2)[:, 0].tolist() == [j + 10.0 for j in range(n)]
    reports = list(ctx.stats.strict.reports)
    pending = torch.zeros(2)
    work = comm.start_all_reduce(pending, g)
    comm.all_reduce(torch.ones(1), g)                         # blocking, behind the all-reduce in flight
    read_float(torch.ones(1), ctx.stats.syncs, "logging")
    comm.wait_work(work, g, "all_reduce")
    read_float(torch.ones(1), ctx.stats.syncs, "logging")     # nothing in flight: no report
    work = comm.start_all_reduce(torch.zeros(2), g)
    comm.all_reduce(torch.ones(1), g)                         # behind it, but the program waits for it
    comm.wait_work(work, g, "all_reduce")                     # before reading: the read asked for no more
    read_float(torch.ones(1), ctx.stats.syncs, "logging")
    return reports, ctx.stats.strict.reports


def test_strict_backend_hides_outputs_orders_the_queue_and_reports_host_reads(multirank):
    for before, after in multirank(_strict_semantics, 2):
        assert len(before) == 1 and "wait for all_gather" in before[0] and "all_reduce on dp" in before[0]
        assert len(after) == 2 and "host read (logging): blocking all_reduce on dp" in after[1]


# ---- through the Trainer: NCCL's paths on the strict backend, against world size 1 ----------------------

MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "model.aux_loss_coef=0",
       "model.z_loss_coef=0"]
CASES = {   # the list: ZeRO 1-3, HSDP, offload, overlap_param_gather, MoE with ep == dp
    "overlap-zero1": (2, ["parallel.dp=2", "parallel.zero=1", "parallel.overlap_param_gather=true"]),
    "overlap-zero2-hsdp": (4, ["parallel.dp=4", "parallel.dp_shard=2", "parallel.zero=2",
                               "parallel.overlap_param_gather=true"]),
    "offload-zero1": (2, ["parallel.dp=2", "parallel.zero=1", "parallel.offload_optimizer=cpu"]),
    "moe-ep-eq-dp-zero1": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.zero=1", *MOE]),
    "moe-ep-eq-dp-zero3": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.zero=3", *MOE]),
}


def _train(worker, overrides, world, strict: bool = True, device: str = "cpu"):
    """The layout's run (worker None: world size 1 on `device`); strict: on the strict backend (gloo)."""
    torch.set_num_threads(1)
    cfg = make_config([*PARITY, f"train.global_batch_size={2 * world}", "model.num_layers=2", *overrides],
                      1 if worker is None else worker.world_size)
    ctx = context_for(cfg, worker, strict=strict and worker is not None)
    if worker is None and device != "cpu":
        ctx = ParallelContext.single(device)
    trainer = build_trainer(cfg, ctx)
    records = [trainer.train_step() for _ in range(STEPS)]
    trainer.optimizer.wait_params()
    weights = {name.split("/", 1)[1]: (t.detach().cpu().clone(), slices, shape)
               for name, (t, shape, slices) in trainer.optimizer.state_tensors().items() if name.startswith("master/")}
    reports = list(ctx.stats.strict.reports) if ctx.stats.strict is not None else []
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "weights": weights, "reports": reports}


def _reference(overrides):
    return [o for o in overrides if not o.startswith(("parallel.dp", "parallel.ep", "parallel.overlap"))]


@pytest.mark.parametrize("name", list(CASES))
def test_nccl_paths_on_the_strict_backend_match_world_size_1(multirank, name):
    world, overrides = CASES[name]
    got = multirank(_train, world, overrides, world)
    assert all(not g["reports"] for g in got), got[0]["reports"]
    check({"precision": "fp32"}, got, _train(None, _reference(overrides), world))


def _train_with_old_followups(worker, overrides, world):
    """Defect 1 as it was: the follow-ups read a size-1 group's output with nothing to wait for."""
    wait = sync.wait_work
    sync.wait_work = lambda work, group, op: None if group.size == 1 else wait(work, group, op)
    try:
        return _train(worker, overrides, world)
    finally:
        sync.wait_work = wait


def test_the_strict_backend_catches_followups_that_skip_a_size1_wait(multirank):
    world, overrides = CASES["moe-ep-eq-dp-zero1"]
    got = multirank(_train_with_old_followups, world, overrides, world)
    assert not all(math.isfinite(n) for n in got[0]["norms"])   # the expert gradients read as NaN


def _train_with_gathers_on_dp(worker, overrides, world):
    """Defect 2 as it was: overlap_param_gather's gathers in flight on DP x CP itself."""
    init = publishing.ParamPublisher.__init__

    def on_dp(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.gather_groups = None
    publishing.ParamPublisher.__init__ = on_dp
    try:
        return _train(worker, overrides, world)
    finally:
        publishing.ParamPublisher.__init__ = init


def test_the_strict_backend_catches_a_host_read_behind_the_parameter_gathers(multirank):
    world, overrides = CASES["overlap-zero1"]
    got = multirank(_train_with_gathers_on_dp, world, overrides, world)
    assert any("all_gather on dp_cp" in r for r in got[0]["reports"]), got[0]["reports"]


def _loop(worker, overrides, world):
    """The run loop (training/loop.py): the step, MoE telemetry after it, evaluation, on the strict backend."""
    from parallel3d.models.moe import MoETransformer
    from parallel3d.training.loop import run_training

    torch.set_num_threads(1)
    cfg = make_config([*PARITY, f"train.global_batch_size={2 * world}", "model.num_layers=2", "train.steps=3",
                       "train.eval_interval=2", "train.eval_steps=1", *overrides], worker.world_size)
    ctx = context_for(cfg, worker, strict=True)

    def build(layers, pre, post):
        return MoETransformer(cfg.model, ctx, layers=layers, pre=pre, post=post)
    records = run_training(cfg, ctx, build)
    return ctx.stats.strict.reports, [r["loss"] for r in records]


def test_the_run_loop_reads_nothing_behind_the_overlapped_gathers(multirank):
    """Defect 2's other read: MoE's load statistics (a DP x CP all-reduce read on the host) right after
    opt.step, with the gathers in flight; and evaluation after a step."""
    overrides = ["parallel.dp=2", "parallel.ep=2", "parallel.zero=1", "parallel.overlap_param_gather=true", *MOE]
    for reports, losses in multirank(_loop, 2, overrides, 2):
        assert not reports and len(losses) == 3 and all(math.isfinite(x) for x in losses), reports
