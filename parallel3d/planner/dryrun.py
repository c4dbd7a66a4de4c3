"""The dry run: the real training step of one rank of any layout, on one CPU, with nothing to compute.

`ParallelContext.simulated` gives the rank its groups (comm's simulated backend: shaped outputs, exact byte
accounting) and the `meta` stand-in device (shapes and placement rules, no values; docs/architecture.md section 2.6).
The real `Trainer` builds the rank's model chunks, `DistributedOptimizer` and pipeline runtime and runs one
full step (forward, backward, gradient sync, clipping, AdamW) under a `StepTracker`, which sees every op:
its allocations (memory per category), FLOPs and bytes (the roofline), and the wall time at which it ran,
so each op's modeled time is attributed to the pipeline action (F, B, I, W of a microbatch and chunk)
that ran it. Collectives are timed by the alpha-beta model as they are recorded.

One rank per distinct role is enough: ranks of a pipeline stage run the same code on the same shapes,
except where the last tensor-parallel / data-parallel rank holds padding or a shorter shard, which the
caller covers by also running the last rank of the last stage.
"""
from __future__ import annotations

import copy
import time
from typing import Callable

import torch
from torch import nn

from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.pipeline.timeline import to_rows
from parallel3d.planner.cost import collective_seconds
from parallel3d.planner.hardware import GPU
from parallel3d.planner.step_costs import RoleRun, base_group, price_step
from parallel3d.planner.tracker import StepTracker
from parallel3d.training.config import ExperimentConfig

BuildStage = Callable[[list[int], bool, bool], nn.Module]
StageBuilder = Callable[[ExperimentConfig, ParallelContext], BuildStage]


class DryRunError(RuntimeError):
    """The real step failed on the stand-in device (a tensor on the wrong device reaching a collective or
    mixing devices in an op, a shape error): the message names the rank, its coordinates and the op."""


def _context(cfg: ExperimentConfig, rank: int, device: str, backend: str,
             expert_load: float = 1.0) -> ParallelContext:
    p = cfg.parallel
    spec = MeshSpec.of(p)
    return ParallelContext.simulated(spec, rank, device, backend, expert_load)


def run_role(cfg: ExperimentConfig, rank: int, stage_builder: StageBuilder, gpu: GPU, gpus_per_node: int,
             device: str = "meta", expert_load: float = 1.0) -> RoleRun:
    """Build and step rank `rank` of resolved config `cfg` on the stand-in device, tracked. `expert_load`: the
    routed rows its MoE layers receive, as a multiple of the balanced share (comm.SimulatedProcessGroup)."""
    from parallel3d.training.trainer import Trainer

    cfg = copy.deepcopy(cfg)
    cfg.train.steps = 1
    ctx = _context(cfg, rank, device, "gloo" if gpu.runs_cpu_kernels else "nccl", expert_load)  # the run's comm
    trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx))
    groups = {g.name: g for g in ctx.groups().values() if g is not None}
    events: list[tuple] = []   # (wall, group, op, seconds, bytes, serial, batch: comm.CommStats.batch)
    waits: dict[int, float] = {}   # serial -> the wall the rank waited for that call at (comm.SimulatedWork)

    def on_collective(group: str, op: str, nbytes: int) -> None:
        g = groups[base_group(group)]
        events.append((time.perf_counter(), group, op, collective_seconds(op, nbytes, g.ranks, gpus_per_node, gpu),
                       nbytes, ctx.stats.serial, ctx.stats.batch))

    ctx.stats.listener = on_collective
    ctx.stats.on_wait = lambda serial: waits.setdefault(serial, time.perf_counter())
    try:
        out, tracker = tracked_step(trainer, torch.device(device).type, signatures=gpu.op_times is not None)
    except (RuntimeError, ValueError, NotImplementedError) as e:
        raise DryRunError(f"dry run of rank {rank} ({ctx.coords}) failed in its training step "
                          f"(last collective: {ctx.stats.last_op or 'none'}): {type(e).__name__}: {e}") from e
    finally:
        ctx.stats.listener = ctx.stats.on_wait = None
    peak, split = tracker.peak()
    live = tracker.live()
    p = cfg.parallel
    pairs = (trainer.schedules.pairs(p.schedule, p.pp, cfg.train.num_microbatches, len(trainer.chunks),
                                     ctx.coords.pp) if p.ep_overlap else ())
    result = price_step(rank, ctx, out, tracker, events, waits, peak, split, live, gpu,
                        trainer.optimizer.per_microbatch, pairs)
    if trainer.optimizer.zero == 3:
        shards = {b.param_flat.untyped_storage() for b in trainer.optimizer.buckets
                  if b.param_flat is not b.adam.master}  # fp32: the shard is the master (optimizer state)
        result.param_shard_bytes = sum(st.nbytes() for st in shards)
    result.activation_offload_bytes = out["activation_offload_bytes"] // max(1, cfg.train.num_microbatches)
    for chunk in trainer.chunks:  # the MoE telemetry the training loop reads after each step (one host sync)
        if hasattr(chunk, "moe_load_stats"):
            chunk.moe_load_stats()
    result.host_syncs = ctx.stats.syncs.summary()  # what the JSONL row reports
    result.peak_without_grads = tracker.peak(exclude=("grads",))[0]
    opt = trainer.optimizer
    sizes = sorted(b.numel * torch.finfo(opt.grad_dtype).bits // 8 for b in opt.buckets)
    result.grad_buckets_in_flight = sum(sizes[-2:])
    return result


def tracked_step(trainer, device_type: str, signatures: bool = False) -> tuple[dict, StepTracker]:
    """One `trainer.train_step()` under a StepTracker (the model state it starts with adopted by category),
    for the dry run and for the real step it is checked against. Returns (the step's record, tracker).
    `signatures`: the tracker also records each distinct op's signature (op_replay.py)."""
    opt = trainer.optimizer
    tracker = StepTracker(device_type=device_type, syncs=trainer.ctx.stats.syncs,
                          signatures={} if signatures else None)
    state = opt.state_by_category()
    for category in ("params", "grads", "optimizer"):
        tracker.adopt(state[category], category, resizable=category == "params" and opt.zero == 3)
    tracker.adopt([b for c in trainer.chunks for b in c.buffers()], "params")
    record: list = []
    with tracker:
        out = trainer.train_step(record=record)
    out["actions"] = to_rows(record)
    owners: dict = {}
    for category, tensors in opt.state_by_category().items():
        for t in tensors:
            owners.setdefault(t.untyped_storage(), category)
    tracker.finish(owners.get)
    return out, tracker
