"""The hot path stays asynchronous on GPUs (issue 30): one training step of each layout runs with
`torch.cuda.set_sync_debug_mode("error")`, so any host sync that is not one of the counted, sanctioned reads
(parallel3d/host_sync.py: the step's handful, the MoE telemetry, the MoE split sizes) raises.

Each test first runs one step without the mode (lazy initialisation: NCCL communicators, Triton compilation,
the pinned host pool), then the checked step. Skipped without CUDA (`gpu`: one GPU; `multigpu`: the worker
pool's NCCL world, one rank per GPU, skipped where fewer GPUs than ranks exist).
"""
from __future__ import annotations

import pytest
import torch

from launch.common import stage_builder
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.models.config import ModelConfig
from parallel3d.training.config import load_config
from parallel3d.training.trainer import Trainer
from parallel3d.training.validate import resolve_and_validate

BASE = ["parallel.tp=1", "model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=128", "model.vocab_size=128", "model.max_seq_len=64", "train.seq_len=32",
        "train.micro_batch_size=1", "train.precision=bf16", "train.steps=2", "train.eval_interval=0"]
MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=64", "model.aux_loss_coef=0.01",
       "model.z_loss_coef=0.001"]
ROUTERS = {
    "softmax": [],
    "softmax-unnormalised": ["model.router_norm_topk=false"],
    "sigmoid-bias-capacity": ["model.router_score=sigmoid", "model.router_bias_update_rate=0.01",
                              "model.capacity_factor=1.0"],
    "grouped-seq-aux-local": ["model.router_score=sigmoid", "model.router_num_groups=2", "model.router_topk_groups=1",
                              "model.seq_aux_loss_coef=0.01", "model.moe_aux_scope=local"],
}


def _config(overrides: list, world: int, microbatches: int = 4):
    p = {o.split("=")[0]: int(o.split("=")[1]) for o in overrides if o.split("=")[0] in
         ("parallel.tp", "parallel.pp", "parallel.cp")}
    dp = world // (p.get("parallel.tp", 1) * p.get("parallel.pp", 1) * p.get("parallel.cp", 1))
    return resolve_and_validate(load_config("configs/tiny.yaml", [*BASE, *overrides,
                                                                  f"train.global_batch_size={microbatches * dp}"],
                                            ModelConfig), world)


def _spec(cfg) -> MeshSpec:
    p = cfg.parallel
    return MeshSpec.of(p)


def checked_step(cfg, ctx: ParallelContext) -> dict:
    """A warm-up step, then one step (and the MoE telemetry the loop logs) with every uncounted sync an error."""
    trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx))
    trainer.train_step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = trainer.train_step()
        for chunk in trainer.chunks:
            if hasattr(chunk, "moe_load_stats"):
                chunk.moe_load_stats()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    out["host_syncs_logged"] = ctx.stats.syncs.summary()
    return out


def _dry_run_syncs(cfg, rank: int) -> dict:
    """The same step's host syncs counted by the meta dry run (what the planner reports)."""
    from parallel3d.planner.dryrun import tracked_step

    ctx = ParallelContext.simulated(_spec(cfg), rank, "meta")
    trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx))
    tracked_step(trainer, "meta")
    for chunk in trainer.chunks:
        if hasattr(chunk, "moe_load_stats"):
            chunk.moe_load_stats()
    return ctx.stats.syncs.summary()


def _layout_worker(w, overrides: list) -> dict:
    cfg = _config(overrides, w.world_size)
    out = checked_step(cfg, w.context(_spec(cfg)))
    return {k: out[k] for k in ("loss", "grad_norm", "host_syncs", "host_syncs_logged")}


def _run_layout(worlds, world: int, overrides: list) -> list[dict]:
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs")
    results = worlds.run(world, _layout_worker, overrides, timeout=600.0)
    cfg = _config(overrides, world)
    for rank, r in enumerate(results):
        assert r["host_syncs_logged"] == _dry_run_syncs(cfg, rank), rank  # the planner counted what ran
    return results


# ---- item 1: host syncs counted and bounded -----------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("impl", ["loop", "padded", "grouped_mm", "triton"])
def test_moe_step_syncs_only_where_counted(router, impl):
    overrides = [*MOE, *ROUTERS[router], f"model.expert_impl={impl}", "train.activation_checkpointing=full"]
    cfg = _config(overrides, 1)
    out = checked_step(cfg, ParallelContext.single("cuda"))
    assert out["host_syncs_logged"] == _dry_run_syncs(cfg, 0)
    assert "upload" not in out["host_syncs_logged"]


@pytest.mark.gpu
def test_dense_step_syncs_only_where_counted():
    cfg = _config(["train.activation_checkpointing=selective"], 1)
    out = checked_step(cfg, ParallelContext.single("cuda"))
    assert out["host_syncs_logged"] == _dry_run_syncs(cfg, 0) and out["host_syncs_logged"]["total"] <= 5


@pytest.mark.multigpu
def test_moe_layout_syncs_only_where_counted(worlds):
    _run_layout(worlds, 4, [*MOE, "parallel.tp=2", "parallel.sp=true", "parallel.ep=2",
                            "train.activation_checkpointing=full"])


# ---- item 2: stream-ordered bucket follow-ups ---------------------------------------------------------------
@pytest.mark.multigpu
@pytest.mark.parametrize("zero", [1, 2, 3])
def test_bucket_follow_ups_need_no_host_wait(worlds, zero):
    _run_layout(worlds, 2, [f"parallel.zero={zero}", "parallel.bucket_size_mb=0.05"])


@pytest.mark.multigpu
def test_hsdp_follow_ups_need_no_host_wait(worlds):
    _run_layout(worlds, 4, ["parallel.zero=3", "parallel.dp_shard=2", "parallel.bucket_size_mb=0.05"])


# ---- item 3: no-copy TP mappings ----------------------------------------------------------------------------
@pytest.mark.multigpu
@pytest.mark.parametrize("sp", ["false", "true"])
def test_tp_mappings_need_no_host_wait(worlds, sp):
    _run_layout(worlds, 2, ["parallel.tp=2", f"parallel.sp={sp}"])


# ---- item 4: DualPipe-V overlap -----------------------------------------------------------------------------
@pytest.mark.multigpu
def test_dualpipe_v_needs_no_host_wait(worlds):
    _run_layout(worlds, 2, ["parallel.pp=2", "parallel.schedule=dualpipe-v", "model.num_layers=4"])


@pytest.mark.multigpu
def test_dualpipe_v_moe_needs_no_host_wait(worlds):
    _run_layout(worlds, 4, [*MOE, "parallel.pp=2", "parallel.ep=2", "parallel.schedule=dualpipe-v",
                            "model.num_layers=4"])


# ---- item 5: tests that see gradients -----------------------------------------------------------------------
@pytest.mark.multigpu
def test_grad_norm_matches_world_size_one_without_host_waits(worlds):
    """dp2 and tp2 steps log the world-size-1 grad_norm (rounding of bf16 compute) with every uncounted sync
    an error; no clipping, so a uniformly scaled gradient would show."""
    single = checked_step(_config(["train.grad_clip=0.0"], 1), ParallelContext.single("cuda"))
    for overrides in (["train.grad_clip=0.0"], ["train.grad_clip=0.0", "parallel.tp=2"]):
        for r in _run_layout(worlds, 2, overrides):
            assert r["grad_norm"] == pytest.approx(single["grad_norm"], rel=2e-2)
            assert r["loss"] == pytest.approx(single["loss"], rel=1e-2)
