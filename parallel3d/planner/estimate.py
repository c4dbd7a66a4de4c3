"""A layout's plan: dry-run one rank per role, then put memory, time and bytes together.

Roles: one rank per pipeline stage (the first of the stage), plus the last rank of the world (the last
tensor-parallel rank holds the vocabulary padding, the last data-parallel rank the shortest ZeRO shard).
Stages with the same layers, ends and shard shapes share their dry run.

Microbatches: the dry-run step runs only as many microbatches as the schedule needs to reach the real
step's peak number of microbatches in flight on every rank (`run_microbatches`), and the full step is then
  - time: the schedule for the real m simulated (pipeline/simulate.py) with each action's modeled cost and
    each pipeline message's alpha-beta cost, plus what runs outside the actions (gradient-sync tail,
    clipping, the optimizer step, ZeRO-1/2 parameter all-gathers), which nothing overlaps;
  - memory: the dry-run peak, with the activations at the peak scaled by the schedule's peak number of
    microbatches in flight for the real m over that of m_run (`peak_in_flight`, counting what zero-bubble
    schedules keep until the weight pass).
"""
from __future__ import annotations

import copy
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Optional

import torch

from parallel3d.expert_parallel.dispatch import check_expert_load
from parallel3d.host_sync import PER_LAYER
from parallel3d.mesh import MeshSpec
from parallel3d.pipeline.pairing import paired_schedule
from parallel3d.pipeline.partition import partition_layers
from parallel3d.pipeline.placement import V_SCHEDULES, chunks_per_rank, placement_of, stage_ids
from parallel3d.pipeline.schedules import SPLIT_BACKWARD, build_schedule
from parallel3d.pipeline.simulate import peak_in_flight, simulate
from parallel3d.planner.dryrun import StageBuilder, run_role
from parallel3d.planner.cost import exposed_buckets
from parallel3d.planner.hardware import GPU
from parallel3d.planner.host_kernels import as_run_on_cpu
from parallel3d.planner.assumptions import eager, notes
from parallel3d.planner.offload import apply_offload, exposed_activation_copies, exposed_offload, without_offload
from parallel3d.planner.step_costs import RoleRun
from parallel3d.tensor_parallel.fp8 import check_fp8_hardware
from parallel3d.training.config import ExperimentConfig
from parallel3d.training.metrics import flops_per_token

MEMORY_KEYS = ("params", "grads", "optimizer", "activations", "comm_buffers", "peak")


@dataclass
class Plan:
    fits: bool
    layout: dict
    memory: dict                     # bytes of the worst rank, by category
    step_time_s: float
    tokens_per_s: float
    mfu: float
    comm_bytes: dict                 # "<group>.<op>" -> bytes, the worst rank's step
    breakdown: dict = field(default_factory=dict)   # seconds by component
    roles: list = field(default_factory=list)       # per role: rank, stage, memory
    bubble: float = 0.0
    host_syncs: dict = field(default_factory=dict)  # category -> host syncs per step, the most of any role
    expert_load: float = 1.0         # the MoE routing load it was planned at (plan's `expert_load`)
    notes: list = field(default_factory=list)       # what the plan assumes where it differs from the run

    def to_json(self) -> dict:
        return {"fits": self.fits, "layout": self.layout, "memory": self.memory,
                "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "comm_bytes": self.comm_bytes, "breakdown": self.breakdown, "bubble": self.bubble,
                "roles": self.roles, "host_syncs": self.host_syncs, "expert_load": self.expert_load,
                "notes": self.notes}


def layout_of(cfg: ExperimentConfig) -> dict:
    p, t = cfg.parallel, cfg.train
    return {"tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep, "etp": p.etp, "dp": p.dp, "zero": p.zero, "sp": p.sp,
            "schedule": p.schedule, "virtual_stages": p.virtual_stages, "micro_batch_size": t.micro_batch_size,
            "activation_checkpointing": t.activation_checkpointing,
            "offload_optimizer": p.offload_optimizer, "offload_params": p.offload_params}


def _chunks(cfg: ExperimentConfig) -> int:
    return chunks_per_rank(cfg.parallel.schedule, cfg.parallel.virtual_stages)


def role_ranks(cfg: ExperimentConfig) -> dict[int, int]:
    """pp rank -> the rank whose dry run stands for it (stages with identical work share one)."""
    p = cfg.parallel
    spec = MeshSpec.of(p)
    v = _chunks(cfg)
    stages = partition_layers(cfg.model.num_layers, p.pp, v, p.layers_per_stage)
    last = p.pp * v - 1
    signature_rank: dict = {}
    out = {}
    for r in range(p.pp):
        ids = stage_ids(r, p.pp, v, placement_of(p.schedule))
        sig = tuple((len(stages[s]), s == 0, s == last) for s in ids)
        out[r] = signature_rank.setdefault(sig, spec.rank(pp=r))
    return out


def run_microbatches(name: str, p: int, m: int, v: int) -> int:
    """The fewest microbatches whose schedule keeps as many microbatches in flight on every rank as the
    real m does (so the dry run's activation peak is the real one), or, where none does (GPipe keeps all m),
    2 * p * v, whose peak is then scaled by `plan`."""
    keeps = name in SPLIT_BACKWARD
    full = [peak_in_flight(r, until_weight=keeps) for r in build_schedule(name, p, m, v)]
    step = p if name == "interleaved" else 1
    start = 2 * p if name in V_SCHEDULES else step  # the V schedules need 2p microbatches
    for trial in range(start, m, step):
        if [peak_in_flight(r, until_weight=keeps) for r in build_schedule(name, p, trial, v)] == full:
            return trial
    return min(m, 2 * p * v)


def _reduced(cfg: ExperimentConfig) -> ExperimentConfig:
    """The same layout with only the microbatches `run_microbatches` asks for."""
    t, p = cfg.train, cfg.parallel
    keep = run_microbatches(p.schedule, p.pp, t.num_microbatches, _chunks(cfg))
    if keep == t.num_microbatches:
        return cfg
    run = copy.deepcopy(cfg)
    run.train.num_microbatches = keep
    run.train.global_batch_size = keep * t.micro_batch_size * p.dp
    return run


def plan(cfg: ExperimentConfig, stage_builder: StageBuilder, gpu: GPU, gpus_per_node: int,
         device: str = "meta", cache: Optional[dict] = None, expert_load: float = 1.0) -> Plan:
    """Dry-run the roles of resolved config `cfg` and estimate its step on `gpu` nodes. `cache`: a dict
    kept across calls, so plans whose dry runs are the same (layouts differing only in offload, which
    the stand-in runs without) share them. `expert_load` (`--moe-load`): the routing imbalance of a
    dropless MoE: each planned rank's experts receive this multiple of the balanced share of the routed
    rows, as the busiest EP rank does (the step waits for it at every exchange); 1.0 is balanced."""
    check_expert_load(expert_load, cfg.parallel.ep, cfg.model.capacity_factor)
    if not gpu.runs_cpu_kernels:   # a CPU run emulates the float8 GEMMs (tensor_parallel/fp8.py _mm)
        check_fp8_hardware(cfg.train.fp8, gpu.name, "fp8" in gpu.peak_flops)
    p, t = cfg.parallel, cfg.train
    run_cfg = _reduced(without_offload(eager(cfg)))  # the stand-in cannot copy to the host: offload.py
    if gpu.runs_cpu_kernels:   # planning a CPU run: the stand-in takes the CPU's kernels (host_kernels.py)
        run_cfg = as_run_on_cpu(run_cfg)

    def role(rank: int) -> RoleRun:
        key = (repr(run_cfg), rank, repr(gpu), gpus_per_node, device, expert_load)
        if cache is None:
            return run_role(run_cfg, rank, stage_builder, gpu, gpus_per_node, device, expert_load)
        if key not in cache:
            cache[key] = run_role(run_cfg, rank, stage_builder, gpu, gpus_per_node, device, expert_load)
        return cache[key]

    by_pp = role_ranks(cfg)
    runs: dict[int, RoleRun] = {}
    for rank in sorted(set(by_pp.values())):
        runs[rank] = role(rank)
    world = MeshSpec.of(p).world_size
    last_rank = world - 1
    if last_rank not in runs:
        runs[last_rank] = role(last_rank)
    stage_run = {r: runs[by_pp[r]] for r in range(p.pp)}
    stage_run[p.pp - 1] = runs[last_rank]
    # every rank dry-run for a stage: a stage's action ends when its slowest rank's does (they meet in its
    # collectives), and the step when the slowest rank's tail does (rank 0 of a group holding replicated
    # gradients norms them alone: data_parallel/clip.py; llama_100m dp2 ZeRO-0, 35 ms more than rank 1's)
    ran_for = {r: [run for run in runs.values() if run.pp_rank == stage_run[r].pp_rank] for r in range(p.pp)}

    v, m, m_run = _chunks(cfg), t.num_microbatches, run_cfg.train.num_microbatches
    schedule = build_schedule(p.schedule, p.pp, m, v)
    keeps_weights = p.schedule in SPLIT_BACKWARD

    # each stage's actions as the plan prices them: its slowest dry-run rank's (they meet in the action's
    # collectives); the schedule and every time figure of the breakdown read them here
    priced = [{key: max((run.actions[key] for run in ran_for[r] if key in run.actions), key=lambda c: c.time_s)
               for key in stage_run[r].actions} for r in range(p.pp)]

    # parallel.ep_overlap: the schedule's back-to-back forward/backward pairs run in turns, their expert
    # all-to-alls beside the partner's compute (pipeline/pairing.py): priced as the dry run's paired instances
    pairs = [{a for pair in rank_pairs for a in pair} for rank_pairs in paired_schedule(schedule)] \
        if p.ep_overlap else [set() for _ in range(p.pp)]
    paired = [{key: max((run.paired_actions[key] for run in ran_for[r] if key in run.paired_actions),
                        key=lambda c: c.time_s) for key in stage_run[r].paired_actions} for r in range(p.pp)]

    def priced_action(rank: int, action):
        key = (action.kind.name, action.chunk)
        return (paired[rank].get(key) if action in pairs[rank] else None) or priced[rank].get(key)

    def cost(rank: int, action) -> float:
        if action.kind.is_compute:
            c = priced_action(rank, action)
            return 0.0 if c is None else c.time_s
        return max(run.p2p_s.get(action.kind.name, 0.0) for run in ran_for[rank])

    timeline = simulate(schedule, costs=cost, lazy_sends=True)
    run_schedule = build_schedule(p.schedule, p.pp, m_run, v)
    def tail(run: RoleRun) -> float:  # what follows the pipeline: the gradient sync's exposed part, then
        last_backward = max((c.compute_s for (kind, _), c in run.actions.items()   # the optimizer
                             if kind in ("BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")), default=0.0)
        return run.outside.time_s + exposed_buckets(run.grad_sync_parts, last_backward)

    outside = max(tail(run) for run in runs.values())
    offload: dict = {}
    roles, worst = [], None
    for r in range(p.pp):
        # the stage's memory is its fullest dry-run rank's (a stage's ranks may hold different shards)
        run = max(ran_for[r], key=lambda x: (x.memory["peak"], x is stage_run[r]))
        full = peak_in_flight(schedule[r], until_weight=keeps_weights)
        # the run stands for stage r but ran as stage run.pp_rank: scale by what that stage kept in flight
        ran = peak_in_flight(run_schedule[run.pp_rank], until_weight=keeps_weights)
        memory = dict(run.memory)
        # offloaded activations leave the device as they are saved: what stays is one microbatch's working set
        extra = 0 if t.activation_offload else memory["activations"] * (full / max(ran, 1) - 1)
        memory["activations"] = int(memory["activations"] + extra)
        memory["peak"] = int(memory["peak"] + extra)
        memory, moved = apply_offload(cfg, memory, run.model_state, run.param_shard_bytes, gpu,
                                      run.memory["peak"] - run.peak_without_grads, run.grad_buckets_in_flight)
        compute = sum(c.compute_s for c in run.actions.values()) * m
        phase = {k: sum(c.compute_s for (kind, _), c in run.actions.items() if kind in kinds)
                 for k, kinds in (("fwd", ("FORWARD",)), ("bwd", ("BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")))}
        moved["param_fetch_s"] *= m
        moved["exposed_s"] = exposed_offload(moved, phase["bwd"], phase["fwd"], compute)
        if run.activation_offload_bytes:
            moved["host_bytes"] += run.activation_offload_bytes * full
            moved["activations_s"] = m * exposed_activation_copies(run.activation_offload_bytes, phase["fwd"],
                                                                   phase["bwd"], gpu)
            moved["exposed_s"] += moved["activations_s"]
        if not offload or moved["exposed_s"] > offload["exposed_s"]:
            offload = moved
        # the stage's own compute (no communication) as a simulated rank of it measures it alone (compare.py)
        stage_compute = {k: c.compute_s for k, c in priced[r].items()}
        roles.append({"pp_rank": r, "rank": run.rank, "memory": memory, "in_flight": full,
                      "compute_s": sum(stage_compute.get((a.kind.name, a.chunk), 0.0) for a in schedule[r]
                                       if a.kind.is_compute),
                      "action_compute_s": {f"{kind}.{chunk}": v for (kind, chunk), v in stage_compute.items()}})
        if worst is None or memory["peak"] > worst[0]["peak"]:
            worst = (memory, run)
    memory, worst_run = worst
    outside += offload["exposed_s"]
    step = timeline.makespan + outside
    tokens = t.global_batch_size * t.seq_len
    flops = flops_per_token(cfg.model, t.seq_len) * tokens
    # Which rank each figure is: times are the priced actions' (`priced`), of the busiest stage where one
    # stage is meant (shares, per-microbatch sums) and averaged over the stages for one action (`action_s`,
    # as a run's timeline averages its ranks'); memory, bytes and their modeled seconds are the fullest rank's.
    busiest = max(range(p.pp), key=timeline.busy)
    per_microbatch = priced[busiest].values()
    action_s: dict = defaultdict(list)
    for stage in priced:
        for (kind, chunk), c in stage.items():
            action_s[f"{kind}.{chunk}"].append(c.time_s)
    breakdown = {"pipeline_s": timeline.makespan, "outside_actions_s": outside, "offload": offload,
                 "shares": _shares(lambda a: priced_action(busiest, a), schedule[busiest], timeline, outside, step),
                 "bubble_fraction": float(timeline.bubble_fraction),
                 "compute_per_microbatch_s": sum(c.compute_s for c in per_microbatch),
                 "blocking_comm_per_microbatch_s": sum(c.blocking_comm_s for c in per_microbatch),
                 "host_stall_per_microbatch_s": sum(c.host_stall_s for c in per_microbatch),
                 "comm_s": worst_run.comm_s, "derated_kernels": worst_run.derated_kernels,
                 "action_s": {k: statistics.mean(v) for k, v in action_s.items()}}
    return Plan(fits=memory["peak"] <= gpu.usable_bytes, layout=layout_of(cfg), memory=memory,
                step_time_s=step, tokens_per_s=tokens / step, mfu=flops / (step * world * peak_for(gpu, t.precision)),
                comm_bytes=_scale_comm(worst_run, m, m_run), breakdown=breakdown, roles=roles,
                bubble=float(timeline.bubble_fraction), host_syncs=_scale_syncs(stage_run.values(), m, m_run),
                expert_load=expert_load, notes=notes(cfg, expert_load, gpu))


def _scale_syncs(runs, m: int, m_run: int) -> dict:
    """Host syncs of the full step, the most of any role per category: the per-layer category (MoE split
    sizes, read once per layer and microbatch) grows with the microbatches, the others are once per step."""
    out: dict = {}
    for run in runs:
        for key, n in run.host_syncs.items():
            if key != "total":
                out[key] = max(out.get(key, 0), n * m // m_run if key in PER_LAYER else n)
    out["total"] = sum(out.values())
    return out


def peak_for(gpu: GPU, precision: str) -> float:
    """The MFU denominator: the dense peak at the training precision (16-bit and fp8 runs: bf16's, as
    published MFUs use; fp32: the rate fp32 matmuls run at, TF32 on a GPU), as the run's MFU does."""
    if precision == "fp32":
        return gpu.peak(torch.float32)
    return gpu.peak_flops["bf16"]


def _scale_comm(run: RoleRun, m: int, m_run: int) -> dict:
    """Bytes of the full step: what moved inside pipeline actions (TP, CP, EP, ZeRO-3 gathers, pipeline
    messages) grows with the number of microbatches; what moved outside them (gradient-sync tail, clipping,
    ZeRO-1/2 parameter gathers) does not. Exact when the dry run ran all m microbatches."""
    if m == m_run:
        return dict(run.comm_bytes)
    out = {}
    for key, total in run.comm_bytes.items():
        inside = run.comm_bytes_in_actions.get(key, 0)
        out[key] = int(total - inside + inside * m / m_run)
    return out


def _shares(action_cost, schedule: list, timeline, outside: float, step: float) -> dict:
    """Where the step goes on the busiest pipeline rank (`action_cost(action)`: its priced compute actions, a
    pair's members at their paired price; its `schedule`): compute,
    TP/EP collectives on the critical path, overlapped communication that compute could not hide, the
    pipeline bubble, and the tail after the pipeline (gradient-sync remainder, clipping, optimizer step,
    ZeRO-1/2 parameter gathers)."""
    parts = {"compute": 0.0, "blocking_comm": 0.0, "exposed_overlapped_comm": 0.0}
    for a in schedule:
        c = action_cost(a) if a.kind.is_compute else None
        if c is not None:
            parts["compute"] += c.compute_s
            parts["blocking_comm"] += c.blocking_comm_s
            parts["exposed_overlapped_comm"] += c.exposed_comm_s
    parts["pipeline_bubble_and_p2p"] = max(0.0, timeline.makespan - sum(parts.values()))
    parts["after_pipeline"] = outside
    return {k: v / step for k, v in parts.items()}
