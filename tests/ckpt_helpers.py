"""Shared helpers for the checkpoint tests: build a tiny Trainer on any layout and train / save / load it.

Workers run inside the gloo world pool (parallel3d.testing) or in-process at world size 1; everything a
worker needs travels as plain arguments (config overrides), so one function covers every layout.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from parallel3d.models.config import ModelConfig
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.training.config import load_config
from parallel3d.training.validate import resolve_and_validate

TINY = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=64", "model.kernels=torch", "train.seq_len=32", "train.global_batch_size=4",
        "train.micro_batch_size=1", "train.steps=6", "train.precision=fp32", "train.warmup_steps=1",
        "parallel.tp=1", "checkpoint.keep=0"]
MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32"]


def make_config(overrides: Sequence[str], world: int):
    return resolve_and_validate(load_config("configs/tiny.yaml", [*TINY, *overrides], ModelConfig), world)


def build_trainer(cfg, ctx):
    from parallel3d.training.trainer import Trainer

    if cfg.model.num_experts:
        from parallel3d.models.moe import MoETransformer as cls
    else:
        from parallel3d.models.llama import Llama as cls
    p = cfg.parallel

    def build(layers, pre, post):
        return cls(cfg.model, ctx, layers=layers, pre=pre, post=post, sequence_parallel=p.sp, cp_mode=p.cp_mode)
    return Trainer(cfg, ctx, build)


def context_for(cfg, worker=None, strict: bool = False) -> ParallelContext:
    """strict: the strict test backend (parallel3d/comm/strict.py: NCCL's ordering rules over gloo)."""
    p = cfg.parallel
    if worker is None:
        return ParallelContext.single()
    return worker.context(MeshSpec.of(p), strict=strict)


def train(worker, overrides: Sequence[str], steps: int, save_root: Optional[str] = None,
          save_at: Sequence[int] = (), load: Optional[str] = None, keep: int = 0, norms: bool = False):
    """Losses of steps [start, steps) at the layout `overrides`, saving at `save_at`, loading `load` first;
    with `norms`, (losses, logged grad norms)."""
    from parallel3d.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    cfg = make_config(overrides, 1 if worker is None else worker.world_size)
    ctx = context_for(cfg, worker)
    trainer = build_trainer(cfg, ctx)
    if load:
        load_checkpoint(trainer, load)
    losses, grad_norms = [], []
    while trainer.step < steps:
        record = trainer.train_step()
        losses.append(record["loss"])
        grad_norms.append(record["grad_norm"])
        if trainer.step in save_at:
            save_checkpoint(trainer, save_root, keep=keep)
    return (losses, grad_norms) if norms else losses


def rel_close(a: Sequence[float], b: Sequence[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(y) for x, y in zip(a, b))


def train_managed(worker, overrides: Sequence[str], steps: int) -> list[float]:
    """Train through CheckpointManager (the policy run_training follows): resume, interval saves, finish."""
    from parallel3d.checkpoint import CheckpointManager

    torch.set_num_threads(1)
    cfg = make_config(overrides, 1 if worker is None else worker.world_size)
    trainer = build_trainer(cfg, context_for(cfg, worker))
    manager = CheckpointManager(trainer, log=False)
    manager.resume()
    losses = []
    while trainer.step < steps:
        losses.append(trainer.train_step()["loss"])
        manager.after_step()
    manager.finish()
    return losses
