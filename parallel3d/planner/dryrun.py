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

import bisect
import copy
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Callable

import torch
from torch import nn

from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.pipeline.schedules import ActionKind
from parallel3d.pipeline.timeline import to_rows
from parallel3d.planner import op_replay
from parallel3d.planner.cost import (collective_seconds, exposed_in_action, hidden_share, op_time, queue_seconds,
                                     wake_seconds)
from parallel3d.planner.hardware import GPU
from parallel3d.planner.kernels import KERNELS_OF_OP, occupancy_factor
from parallel3d.planner.tracker import CATEGORIES, StepTracker
from parallel3d.training.config import ExperimentConfig

BuildStage = Callable[[list[int], bool, bool], nn.Module]
StageBuilder = Callable[[ExperimentConfig, ParallelContext], BuildStage]

# collectives that run beside compute: ring-attention p2p, ZeRO-3 prefetch gathers, DP bucket reductions
DP_GROUPS = ("dp_cp", "edp", "dp", "dp_shard", "edp_shard", "dp_rep", "dp_node", "edp_node")
OVERLAPPED_GROUPS = ("cp",) + DP_GROUPS
REDUCTIONS = ("reduce_scatter", "all_reduce", "all_to_all")  # qgZ and gloo's reduce-scatter: all-to-all


def base_group(group: str) -> str:
    """Compressed traffic is recorded as "<group>_compressed" (data_parallel/compression.py)."""
    return group[: -len("_compressed")] if group.endswith("_compressed") else group


def is_grad_sync(group: str, op: str) -> bool:
    """Gradient reductions over data-parallel groups: once per step (launched during the last
    microbatch's backward, bucket by bucket), whatever the number of microbatches -- unless the optimizer
    reduces per microbatch (ZeRO-2/3, offload: `RoleRun.per_microbatch`), where they belong to each
    backward like the other overlapped traffic."""
    return base_group(group) in DP_GROUPS and op in REDUCTIONS


class DryRunError(RuntimeError):
    """The real step failed on the stand-in device (a tensor on the wrong device reaching a collective or
    mixing devices in an op, a shape error): the message names the rank, its coordinates and the op."""


@dataclass
class ActionCost:
    """Modeled seconds of one pipeline action (one microbatch of one chunk)."""
    compute_s: float = 0.0
    flops: float = 0.0
    blocking_comm_s: float = 0.0     # TP / EP collectives, and what of the others a CPU's compute pays
    overlapped_comm_s: float = 0.0   # CP ring, ZeRO-3 gathers, DP reductions: run beside compute
                                     # (on a CPU whose cores the ranks fill, their idle share: cost.hidden_share)
    host_stall_s: float = 0.0        # the part of compute_s the device waits for the host (cost.queue_seconds)
    ops: float = 0.0                 # ops the dry run counted in it
    exposed_comm_s: float = 0.0      # what the action waits for of overlapped_comm_s (cost.exposed_in_action)

    @property
    def time_s(self) -> float:
        return self.compute_s + self.blocking_comm_s + self.exposed_comm_s


@dataclass
class RoleRun:
    rank: int
    pp_rank: int
    memory: dict                       # bytes per category at the step's peak, and "peak"
    model_state: dict                  # params / grads / optimizer bytes alive after the step
    actions: dict                      # (kind name, chunk) -> mean ActionCost per microbatch
    p2p_s: dict                        # comm kind name -> mean seconds per message
    outside: ActionCost                # optimizer step, gradient-sync tail, clipping, loss reductions
    comm_bytes: dict                   # "<group>.<op>" -> bytes in the step (the JSONL field)
    comm_s: dict = field(default_factory=dict)  # "<group>.<op>" -> modeled seconds in the step
    comm_bytes_in_actions: dict = field(default_factory=dict)  # the part of comm_bytes moved inside actions
    flops: float = 0.0
    derated_kernels: dict = field(default_factory=dict)  # our kernel -> warps per SM and its time factor
    param_shard_bytes: int = 0         # ZeRO-3's persistent parameter shards (what offload_params moves)
    activation_offload_bytes: int = 0  # train.activation_offload: saved bytes sent to the host, per microbatch
    host_syncs: dict = field(default_factory=dict)  # category -> host syncs in the step (parallel3d.host_sync)
    peak_without_grads: int = 0        # the step's peak not counting gradients (offload takes them off)
    grad_buckets_in_flight: int = 0    # bytes of the two largest gradient buckets (what offload keeps)
    op_seconds: dict = field(default_factory=dict)  # op name -> [count, modeled seconds] in the step
    # DP gradient reductions, the seconds of each that can hide (cost.hidden_share), in launch (bucket) order:
    # once per step, behind the last backward as their buckets become ready (cost.exposed_buckets); the
    # rest of them is in `outside`
    grad_sync_parts: list = field(default_factory=list)


def _context(cfg: ExperimentConfig, rank: int, device: str, backend: str,
             expert_load: float = 1.0) -> ParallelContext:
    p = cfg.parallel
    spec = MeshSpec(tp=p.tp, cp=p.cp, dp=p.dp, pp=p.pp, ep=p.ep, dp_shard=p.dp_shard, gpus_per_node=p.gpus_per_node)
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
    events: list[tuple[float, str, str, float, int, int]] = []   # (wall, group, op, seconds, bytes, serial)
    waits: dict[int, float] = {}   # serial -> the wall the rank waited for that call at (comm.SimulatedWork)

    batch_s = [0, 0.0]   # (first call, seconds so far) of the batch being recorded (comm.CommStats.batch)

    def on_collective(group: str, op: str, nbytes: int) -> None:
        g = groups[base_group(group)]
        seconds = collective_seconds(op, nbytes, g.ranks, gpus_per_node, gpu)
        if batch_s[0] != ctx.stats.batch:
            batch_s[:] = [ctx.stats.batch, 0.0]
        # the sends and receives of one batch travel together: the batch lasts its longest transfer (gloo's
        # send probe times a send and a receive posted together: profile_gloo.py)
        seconds, batch_s[1] = max(0.0, seconds - batch_s[1]), max(batch_s[1], seconds)
        events.append((time.perf_counter(), group, op, seconds, nbytes, ctx.stats.serial))

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
    result = _summarise(rank, ctx, out, tracker, events, waits, peak, split, live, gpu,
                        trainer.optimizer.per_microbatch)
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


def _cold_seconds(op, gpu: GPU, cold_output_s: float = 0.0) -> float:
    """What a replayed op (its inputs hot in cache, its output written where its last call's was) lacks in
    the step: the inputs the step last touched more than the cache ago come from memory (an op whose own
    traffic exceeds the cache streamed from memory when it was replayed too, and gets nothing for them),
    and an op that allocates its output writes it into memory the step last used long ago
    (`cold_output_s`, its replayed extra: op_replay.replay_cold_output)."""
    written = cold_output_s if op.fresh_bytes else 0.0
    if op.nbytes > gpu.cache_bytes:
        return written
    cold = sum(n for n, distance in op.reuse if distance < 0 or distance > gpu.cache_bytes)
    return cold * gpu.cold_s_per_byte + written


def _with_waits(events: list, waits: dict) -> list:
    """The dry run's collectives and the rank's waits for them (as (wall, None, None, 0, 0, serial)), in
    the order the rank met them."""
    return sorted([*events, *((wall, None, None, 0.0, 0, serial) for serial, wall in waits.items())],
                  key=lambda e: e[0])


def action_index(out: dict, pp_rank: int):
    """(this stage's actions in run order, wall -> the index of the action running at that wall, -1 outside
    them): actions run one after another, so bisect finds an op's or a collective's action."""
    mine = sorted((r for r in out["actions"] if r[0] == pp_rank), key=lambda r: r[5])
    starts = [r[5] for r in mine]

    def index(wall: float) -> int:
        i = bisect.bisect_right(starts, wall) - 1
        return i if i >= 0 and wall <= mine[i][6] else -1
    return mine, index


def in_order_stretches(out: dict, tracker: StepTracker, pp_rank: int) -> tuple[list, list]:
    """The step's op signatures cut by action (op_replay.segments), and each op's stretch key prefix
    (op_replay.in_order_key), as a plan prices ops in order and the profile calibrates the per-op cost."""
    _, index = action_index(out, pp_rank)
    stretches = op_replay.segments([op.key for op in tracker.ops], [index(op.wall) for op in tracker.ops])
    return stretches, [op_replay.in_order_key(s, "") for s in stretches for _ in s]


def _summarise(rank, ctx, out, tracker, events, waits, peak, split, live, gpu: GPU, per_microbatch: bool
               ) -> RoleRun:
    mine, index = action_index(out, ctx.coords.pp)
    costs = [ActionCost() for _ in mine]
    outside = ActionCost()

    def slot(wall: float) -> ActionCost:
        i = index(wall)
        return costs[i] if i >= 0 else outside

    derated: dict = {}
    op_seconds: dict = {}
    # a measured machine: each op at its replayed time plus the host's own per-op cost (op_replay.py)
    stretches, prefixes = in_order_stretches(out, tracker, ctx.coords.pp)
    measured = (op_replay.measure(tracker.signatures, gpu.op_times, stretches)
                if gpu.op_times is not None else {})
    queued: dict = defaultdict(list)  # id(slot) -> its ops' device seconds in issue order
    walls, done = [], [0.0]           # op walls and the modeled seconds of the ops up to each (prefix sums)
    marks: dict = defaultdict(list)   # action index -> (wall, mark): its ops and collectives (cost.exposed_in_action)
    for op, in_order in zip(tracker.ops, prefixes):
        c = slot(op.wall)
        factor = 1.0
        if op.name in KERNELS_OF_OP:
            found = occupancy_factor(gpu.name, op.name, str(op.dtype), op.head_dim, op.causal)
            if found is not None:
                factor, warps = found
                derated.update({k: {"warps_per_sm": w, "factor": factor} for k, w in warps.items()})
        replayed = op_replay.replayed_seconds(measured, op.key, in_order)
        if replayed is not None:
            cold_output = (measured.get(op_replay.COLD + op.key) or 0.0) * gpu.op_time_scale
            seconds = replayed * gpu.op_time_scale + _cold_seconds(op, gpu, cold_output) + gpu.op_overhead_s
        else:
            seconds = op_time(op.flops, op.nbytes, gpu.peak(op.dtype), gpu, factor, op.dtype, op.name)
        c.compute_s += seconds
        if c is not outside:
            marks[index(op.wall)].append((op.wall, ("op", seconds)))
        c.flops += op.flops
        queued[id(c)].append(seconds)
        walls.append(op.wall)
        done.append(done[-1] + seconds)
        tally = op_seconds.setdefault(op.name, [0, 0.0])  # per op: what a profile of the real step is set beside
        tally[0] += 1
        tally[1] += seconds
    for c in [*costs, outside]:
        c.ops = len(queued[id(c)])
        issue = gpu.host_step_op_s if c is outside else gpu.host_op_s
        if issue:  # a GPU's queue runs behind the host: an action lasts its queue's span
            span = queue_seconds(queued[id(c)], issue)
            c.host_stall_s = max(0.0, span - c.compute_s)
            c.compute_s = max(span, c.compute_s)
    comm_s: dict = defaultdict(float)
    inside: dict = defaultdict(int)
    grad_sync_parts: list = []
    last_call = float("-inf")    # the wall of this rank's last collective, of any kind (cost.wake_seconds)
    started: dict = {}   # serial -> the action index an overlapped collective started in
    for wall, group, op, seconds, nbytes, serial in _with_waits(events, waits):
        if group is None:   # the rank waits for call `serial`: a mark where it started in this action
            if started.get(serial, -1) == index(wall) >= 0:
                marks[started[serial]].append((wall, ("wait", serial)))
            continue
        c = slot(wall)
        grad_sync = c is not outside and is_grad_sync(group, op) and not per_microbatch
        # started beside compute, not waited in at once
        beside = c is not outside and (grad_sync or base_group(group) in OVERLAPPED_GROUPS)
        # arriving from compute costs every call more, started beside compute or not; the extra is split
        # like the rest of the call between the rank's cores and what hides (cost.wake_seconds)
        since = done[bisect.bisect_right(walls, wall)] - done[bisect.bisect_right(walls, last_call)]
        seconds += wake_seconds(op, since, gpu)
        last_call = wall
        comm_s[f"{group}.{op}"] += seconds
        hidden = seconds * hidden_share(op, gpu) if beside else 0.0   # the rest takes the ranks' cores
        if grad_sync:   # once per step, not per microbatch: estimate.plan hides it behind the last backward
            grad_sync_parts.append(hidden)
            outside.blocking_comm_s += seconds - hidden
            continue
        if c is not outside:
            inside[f"{group}.{op}"] += nbytes  # pipeline messages land in their SEND/RECV action
            i = index(wall)
            marks[i].append((wall, ("block", seconds - hidden)))   # what the rank pays at the call, then
            if hidden:                                             # the transfer beside its compute
                marks[i].append((wall, ("start", serial, base_group(group), hidden)))
                started[serial] = i
        c.overlapped_comm_s += hidden
        c.blocking_comm_s += seconds - hidden
    for i, c in enumerate(costs):
        timeline = [mark for _, mark in sorted(marks[i], key=lambda m: m[0])]   # (stable: a call's two marks)
        c.exposed_comm_s = exposed_in_action(timeline, gpu.host_op_s or 0.0)
    per_action: dict = defaultdict(list)
    p2p: dict = defaultdict(list)
    for row, c in zip(mine, costs):
        if ActionKind[row[1]].is_compute:
            per_action[(row[1], row[3])].append(c)
        else:
            p2p[row[1]].append(c.blocking_comm_s)
    actions = {k: ActionCost(**{f.name: statistics.mean(getattr(c, f.name) for c in v) for f in fields(ActionCost)})
               for k, v in per_action.items()}
    memory = {k: split[k] for k in CATEGORIES}
    memory["peak"] = peak
    return RoleRun(rank=rank, pp_rank=ctx.coords.pp, memory=memory,
                   model_state={k: live[k] for k in ("params", "grads", "optimizer")}, actions=actions,
                   p2p_s={k: statistics.mean(v) for k, v in p2p.items()}, outside=outside,
                   grad_sync_parts=grad_sync_parts,
                   comm_bytes=dict(out["comm_bytes"]), comm_s=dict(comm_s), comm_bytes_in_actions=dict(inside),
                   flops=sum(o.flops for o in tracker.ops), derated_kernels=derated, op_seconds=op_seconds)
