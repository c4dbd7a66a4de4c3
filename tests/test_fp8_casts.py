"""train.fp8's weight casts, once per optimizer step (tensor_parallel/fp8.py Fp8Casts), through the real
Trainer: with 4 microbatches each fp8 weight is cast once per step per scale axis (tensorwise one copy,
rowwise two: rows for y, columns for dx), and the run is bit-identical to the run that casts at every use
(losses and every parameter after the steps). ZeRO-3 casts at every use (its weights are gathered per use).
The fused Triton casts (forced, under the interpreter) give the same run as the torch twin, bit for bit."""
from __future__ import annotations

import os

import pytest
import torch

from ckpt_helpers import make_config
from parallel3d.tensor_parallel.fp8 import casts_of

MICROBATCHES = 4  # ckpt_helpers' TINY: global batch 4, micro batch 1


def _trainer(overrides, worker=None):
    from ckpt_helpers import context_for
    from launch.common import stage_builder
    from parallel3d.training.trainer import Trainer

    torch.set_num_threads(1)
    cfg = make_config(["train.precision=bf16", *overrides], 1 if worker is None else worker.world_size)
    ctx = context_for(cfg, worker)
    return Trainer(cfg, ctx, stage_builder(cfg, ctx))


def _run(trainer, steps, params=True):
    """(losses, parameters after the steps, weight casts per step, fp8 layer count); ZeRO-3 (params=False)
    holds no parameter values between steps."""
    casts = casts_of(trainer.chunks)
    layers = sum(1 for c in trainer.chunks for m in c.modules() if getattr(m, "fp8_casts", None) is not None)
    losses, counts = [], []
    for _ in range(steps):
        before = sum(c.weight_casts for c in casts)
        losses.append(trainer.train_step()["loss"])
        counts.append(sum(c.weight_casts for c in casts) - before)
    assert all(not c.copies for c in casts), "the step's copies are dropped when it ends"
    weights = [p.detach().clone() for c in trainer.chunks for p in c.parameters()] if params else []
    return losses, weights, counts, layers


def _same_run(a, b):
    assert a[0] == b[0], f"losses {a[0]} vs {b[0]}"
    assert all(torch.equal(x, y) for x, y in zip(a[1], b[1])), "parameters differ"


@pytest.mark.parametrize("recipe,layout", [("tensorwise", []), ("rowwise", []),
                                           ("tensorwise", ["parallel.zero=1"]),
                                           ("rowwise", ["train.activation_checkpointing=full"])])
def test_weights_cast_once_per_step_and_the_run_is_the_uncached_one(recipe, layout):
    overrides = [f"train.fp8={recipe}", *layout]
    cached = _run(_trainer(overrides), 3)
    assert _trainer(overrides).cfg.train.num_microbatches == MICROBATCHES
    uncached_trainer = _trainer(overrides)
    uncached_trainer.fp8_casts = []  # never opened: every use casts
    uncached = _run(uncached_trainer, 3)
    _same_run(cached, uncached)
    layers, axes = cached[3], 1 if recipe == "tensorwise" else 2
    assert layers >= 7 * 2  # q, k, v, o, gate, up, down in each of 2 blocks (the head stays bf16)
    assert cached[2] == [layers * axes] * 3
    uses = 3 if layout == ["train.activation_checkpointing=full"] else 2  # forward (recomputed), backward
    assert uncached[2] == [layers * MICROBATCHES * uses] * 3


def _cached_and_uncached(worker, overrides, steps):
    cached = _run(_trainer(overrides, worker), steps)
    uncached_trainer = _trainer(overrides, worker)
    uncached_trainer.fp8_casts = []
    return cached, _run(uncached_trainer, steps)


def test_zero2_in_place_publishing_recasts_after_each_step(worlds):
    """dp=2, ZeRO-2: the optimizer's all-gather publishes into the parameters in place between steps; the
    copies of a step are never read in the next (else the run would drift from the uncached one)."""
    overrides = ["train.fp8=tensorwise", "parallel.zero=2", "train.micro_batch_size=1", "train.global_batch_size=8"]
    for cached, uncached in worlds.run(2, _cached_and_uncached, overrides, 3):
        _same_run(cached, uncached)
        assert cached[2] == [cached[3]] * 3 and uncached[2] == [cached[3] * MICROBATCHES * 2] * 3


def test_zero3_casts_at_every_use():
    """ZeRO-3 frees each weight after use and gathers it again: no copy outlives the gathered weight."""
    losses, _, counts, layers = _run(_trainer(["train.fp8=tensorwise", "parallel.zero=3"]), 2, False)
    assert counts == [layers * MICROBATCHES * 2] * 2
    ref = _run(_trainer(["train.fp8=tensorwise"]), 2)[0]
    assert losses == pytest.approx(ref, rel=1e-3)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="forces Triton on CPU tensors: the interpreter")
def test_triton_casts_give_the_twins_run():
    """The fused kernels (forced; the interpreter on this CPU) against the twin, through the Trainer."""
    def run(backend):
        trainer = _trainer(["train.fp8=rowwise", "model.num_layers=1"])
        for casts in casts_of(trainer.chunks):
            casts.backend = backend
        return _run(trainer, 2)
    _same_run(run("triton"), run("torch"))


@pytest.mark.parametrize("recipe,per_mb,per_step", [("tensorwise", 3, 1), ("rowwise", 4, 2)])
def test_planner_dry_run_prices_the_fused_casts_once_per_step_for_weights(recipe, per_mb, per_step):
    """The meta dry run (planner) runs what CUDA runs: the fused cast ops, and the weights' casts once per
    step: per fp8 layer, `per_mb` activation/gradient casts per microbatch plus `per_step` weight casts
    (tensorwise: x, dy, x for dW; rowwise: x, dy, dy and x by columns for dW; the weight by rows and columns)."""
    from launch.common import stage_builder
    from parallel3d.planner.dryrun import run_role
    from parallel3d.planner.hardware import gpu

    op = "fp8_scale_cast" if recipe == "tensorwise" else "fp8_cast_axis"
    counts, gemms = [], []
    for microbatches in (1, MICROBATCHES):
        cfg = make_config(["train.precision=bf16", f"train.fp8={recipe}", "model.kernels=auto",
                           f"train.global_batch_size={microbatches}"], 1)
        run = run_role(cfg, 0, stage_builder, gpu("h100"), 8)
        counts.append(run.op_seconds[op][0])
        gemms.append(run.op_seconds["_scaled_mm"][0])
    layers = counts[0] // (per_mb + per_step)
    assert layers >= 14 and counts == [layers * (per_mb + per_step), layers * (per_mb * MICROBATCHES + per_step)]
    assert gemms == [3 * layers, 3 * layers * MICROBATCHES]  # y, dx, dW per microbatch


@pytest.mark.parametrize("recipe,casts_per_step", [("tensorwise", 1), ("rowwise", 2)])
def test_the_dx_copy_is_kept_transposed(recipe, casts_per_step):
    """dx = dy @ W takes W^T contiguous (column-major for _scaled_mm): that copy is made once per step too, by
    transposing y's copy (tensorwise) or casting the column-scaled one (rowwise), not in every backward."""
    from parallel3d.mesh import ParallelContext
    from parallel3d.tensor_parallel.fp8 import Fp8Casts
    from parallel3d.tensor_parallel.layers import ColumnParallelLinear, convert_to_fp8

    layer = ColumnParallelLinear(32, 48, ParallelContext.single().tp).bfloat16()
    casts = Fp8Casts("torch")
    convert_to_fp8(layer, recipe, casts)
    casts.open()
    for _ in range(3):
        layer(torch.randn(2, 5, 32, dtype=torch.bfloat16, requires_grad=True)).sum().backward()
    assert casts.weight_casts == casts_per_step
    (w8, _), = [copy for (_, _, col), (_, copy) in casts.copies.items() if col]
    assert w8.shape == (48, 32) and w8.t().is_contiguous()
    casts.close()


def _backends_run(worker, overrides, steps):
    out = []
    for backend in ("triton", "torch"):
        trainer = _trainer(overrides, worker)
        for casts in casts_of(trainer.chunks):
            casts.backend = backend
        out.append(_run(trainer, steps))
    return out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="forces Triton on CPU tensors: the interpreter")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_triton_casts_under_tensor_parallelism(worlds, recipe):
    """tp=2 with sp: the amaxes MAX all-reduced between the kernels' amax and cast passes; the same run as
    the twin's on every rank, bit for bit."""
    overrides = ["parallel.tp=2", "parallel.sp=true", f"train.fp8={recipe}", "model.num_layers=1"]
    for triton_run, torch_run in worlds.run(2, _backends_run, overrides, 2):
        _same_run(triton_run, torch_run)
