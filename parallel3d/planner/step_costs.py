"""Pricing a rank's dry-run step (planner/dryrun.py records it): each op at its replayed or roofline time,
each collective at its alpha-beta time plus the wake extra, attributed to the pipeline action that ran it
(F, B, I, W of a microbatch and chunk) or to the step outside the actions; what of a collective started
beside compute hides (cost.hidden_share) and what its action waits for (cost.exposed_in_action)."""
from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, fields
from typing import Sequence

from parallel3d.pipeline.schedules import ActionKind
from parallel3d.planner import op_replay
from parallel3d.planner.cost import exposed_in_action, hidden_share, op_time, queue_seconds, wake_seconds
from parallel3d.planner.hardware import GPU
from parallel3d.planner.kernels import KERNELS_OF_OP, occupancy_factor
from parallel3d.planner.tracker import CATEGORIES, StepTracker

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
    actions: dict                      # (kind name, chunk) -> mean ActionCost per microbatch (unpaired)
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
    # parallel.ep_overlap: (kind name, chunk) -> mean ActionCost of the instances run in a pair (their expert
    # all-to-alls hidden behind the partner: pipeline/pairing.py), which the plan's pairs are priced at
    paired_actions: dict = field(default_factory=dict)


def cold_seconds(op, gpu: GPU, cold_output_s: float = 0.0) -> float:
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
    """The dry run's collectives and the rank's waits for them (as (wall, None, None, 0, 0, serial, 0)), in
    the order the rank met them."""
    return sorted([*events, *((wall, None, None, 0.0, 0, serial, 0) for serial, wall in waits.items())],
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


def message_action(mine: list, i: int, op: str, taken: dict) -> int:
    """The action of a pipeline message the dry run met at action `i` (action_index): a posted group's
    actions share the post's window (pipeline/executor.py), and `i` is the window's last; the window's n-th
    send (receive) is its n-th SEND (RECV) action, as the group posts them in the schedule's order.
    `taken`: (window, op) -> the messages placed so far."""
    if i < 0 or op not in ("send", "recv") or ActionKind[mine[i][1]].is_compute:
        return i
    first = i
    while first > 0 and mine[first - 1][5] == mine[i][5]:
        first -= 1
    own = [j for j in range(first, i + 1) if ActionKind[mine[j][1]].is_send == (op == "send")]
    if not own:
        return i
    n = taken.get((first, op), 0)
    taken[(first, op)] = n + 1
    return own[min(n, len(own) - 1)]


def in_order_stretches(out: dict, tracker: StepTracker, pp_rank: int) -> tuple[list, list]:
    """The step's op signatures cut by action (op_replay.segments), and each op's stretch key prefix
    (op_replay.in_order_key), as a plan prices ops in order and the profile calibrates the per-op cost."""
    _, index = action_index(out, pp_rank)
    stretches = op_replay.segments([op.key for op in tracker.ops], [index(op.wall) for op in tracker.ops])
    return stretches, [op_replay.in_order_key(s, "") for s in stretches for _ in s]


def price_step(rank, ctx, out, tracker, events, waits, peak, split, live, gpu: GPU, per_microbatch: bool,
               pairs: Sequence = ()) -> RoleRun:
    """One rank's recorded dry-run step priced (run_role's `events`: its collectives as recorded, with
    their alpha-beta seconds; `waits`: the walls it waited for started ones at) into a RoleRun: each op and
    collective attributed to the pipeline action that ran it. `pairs` (parallel.ep_overlap: this rank's
    backward/forward pairs, pipeline/pairing.py): their turns are recorded as several rows per action, and
    an expert all-to-all one member starts hides behind whatever either member runs before it is waited."""
    mine, index = action_index(out, ctx.coords.pp)
    costs = [ActionCost() for _ in mine]
    outside = ActionCost()
    instance = [(r[1], r[2], r[3]) if ActionKind[r[1]].is_compute else ("comm", i) for i, r in enumerate(mine)]
    pair_of = {(a.kind.name, a.microbatch, a.chunk): ("pair", n) for n, pair in enumerate(pairs) for a in pair}

    def timeline_of(i: int):
        """The marks' timeline row i belongs to: its pair's (both members' turns, in wall order) or its own."""
        return pair_of.get(instance[i], i) if i >= 0 else None
    rows_of: dict = defaultdict(list)       # timeline -> its rows
    for j in range(len(mine)):
        rows_of[timeline_of(j)].append(j)

    derated: dict = {}
    op_seconds: dict = {}
    # a measured machine: each op at its replayed time plus the host's own per-op cost (op_replay.py)
    stretches, prefixes = in_order_stretches(out, tracker, ctx.coords.pp)
    measured = (op_replay.measure(tracker.signatures, gpu.op_times, stretches)
                if gpu.op_times is not None else {})
    queued: dict = defaultdict(list)  # queue (an action's row, a pair, "outside") -> its ops' device seconds in order
    walls, done = [], [0.0]           # op walls and the modeled seconds of the ops up to each (prefix sums)
    marks: dict = defaultdict(list)   # action index -> (wall, mark): its ops and collectives (cost.exposed_in_action)
    for op, in_order in zip(tracker.ops, prefixes):
        i = index(op.wall)
        c = costs[i] if i >= 0 else outside
        factor = 1.0
        if op.name in KERNELS_OF_OP and op.name not in (gpu.attention_efficiency or {}):  # measured: as it ran
            found = occupancy_factor(gpu.name, op.name, str(op.dtype), op.head_dim, op.causal)
            if found is not None:
                factor, warps = found
                derated.update({k: {"warps_per_sm": w, "factor": factor} for k, w in warps.items()})
        replayed = op_replay.replayed_seconds(measured, op.key, in_order)
        if replayed is not None:
            cold_output = (measured.get(op_replay.COLD + op.key) or 0.0) * gpu.op_time_scale
            seconds = replayed * gpu.op_time_scale + cold_seconds(op, gpu, cold_output) + gpu.op_overhead_s
        else:
            seconds = op_time(op.flops, op.nbytes, gpu.peak(op.dtype), gpu, factor, op.dtype, op.name)
        c.compute_s += seconds
        if c is not outside:
            marks[timeline_of(i)].append((op.wall, ("op", seconds)))
        c.flops += op.flops
        queued["outside" if c is outside else timeline_of(i)].append(seconds)
        c.ops += 1
        walls.append(op.wall)
        done.append(done[-1] + seconds)
        tally = op_seconds.setdefault(op.name, [0, 0.0])  # per op: what a profile of the real step is set beside
        tally[0] += 1
        tally[1] += seconds
    for key, seconds in queued.items():
        issue = gpu.host_step_op_s if key == "outside" else gpu.host_op_s
        if not issue:
            continue
        # a GPU's queue runs behind the host: an action lasts its queue's span (a pair's turns are one queue,
        # the host issuing both members' ops in turn; its stall is shared by their compute)
        members = [outside] if key == "outside" else [costs[j] for j in rows_of[key]]
        total = sum(seconds)
        stall = max(0.0, queue_seconds(seconds, issue) - total)
        for c in members:
            c.host_stall_s = stall * (c.compute_s / total if total else 1 / len(members))
            c.compute_s += c.host_stall_s
    comm_s: dict = defaultdict(float)
    inside: dict = defaultdict(int)
    grad_sync_parts: list = []
    last_call = float("-inf")    # the wall of this rank's last collective, of any kind (cost.wake_seconds)
    started: dict = {}   # serial -> the action index an overlapped collective started in
    longest: dict = {}   # batch (comm.CommStats.batch) -> its longest transfer priced so far
    taken: dict = {}     # (post window, op) -> the pipeline messages placed in it (message_action)
    for wall, group, op, seconds, nbytes, serial, batch in _with_waits(events, waits):
        if group is None:   # the rank waits for call `serial`: a mark where it started in this action (pair)
            key = timeline_of(index(wall))
            if key is not None and started.get(serial) == key:
                marks[key].append((wall, ("wait", serial)))
            continue
        i = message_action(mine, index(wall), op, taken)
        c = costs[i] if i >= 0 else outside
        if i < 0 or ActionKind[mine[i][1]].is_compute:
            # the sends and receives of one batch travel together and the action waits for them all: the
            # batch lasts its longest transfer (gloo's send probe times a send and a receive posted together).
            # A pipeline action keeps each message's price: the schedule simulator pairs the messages itself
            before = longest.get(batch, 0.0)
            longest[batch] = max(before, seconds)
            seconds = max(0.0, seconds - before)
        grad_sync = c is not outside and is_grad_sync(group, op) and not per_microbatch
        # started beside compute, not waited in at once
        # an expert all-to-all the code started (and waited later) runs beside compute: inside an ep_overlap
        # pair (interleave.py) and under model.moe_delay_wgrad (delayed_wgrad.py); a blocking one has no wait
        started_a2a = op == "all_to_all" and serial in waits
        beside = c is not outside and (grad_sync or base_group(group) in OVERLAPPED_GROUPS or started_a2a)
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
            key = timeline_of(i)
            marks[key].append((wall, ("block", seconds - hidden)))   # what the rank pays at the call, then
            if hidden:                                               # the transfer beside its compute
                marks[key].append((wall, ("start", serial, base_group(group), hidden)))
                started[serial] = key
        c.overlapped_comm_s += hidden
        c.blocking_comm_s += seconds - hidden
    # one cost per action: the rows of its turns in a pair summed
    merged: dict = {}
    for key, c in zip(instance, costs):
        m = merged.setdefault(key, ActionCost())
        for f in fields(ActionCost):
            setattr(m, f.name, getattr(m, f.name) + getattr(c, f.name))
    for key, timeline_marks in marks.items():
        timeline = [mark for _, mark in sorted(timeline_marks, key=lambda m: m[0])]   # (stable: a call's two marks)
        exposed = exposed_in_action(timeline, gpu.host_op_s or 0.0)
        members = list(dict.fromkeys(instance[j] for j in rows_of[key]))   # the pair's two actions, or one
        hidden = sum(merged[k].overlapped_comm_s for k in members)
        for k in members:   # a pair's wait shared by what each member started
            merged[k].exposed_comm_s = exposed * (merged[k].overlapped_comm_s / hidden if hidden else 1 / len(members))
    per_action: dict = defaultdict(list)
    per_paired: dict = defaultdict(list)
    p2p: dict = defaultdict(list)
    for key, c in merged.items():
        if key[0] == "comm":
            p2p[mine[key[1]][1]].append(c.blocking_comm_s)
        else:
            (per_paired if key in pair_of else per_action)[(key[0], key[2])].append(c)

    def mean(costs: list) -> ActionCost:
        return ActionCost(**{f.name: statistics.mean(getattr(c, f.name) for c in costs) for f in fields(ActionCost)})
    # an action the dry run only ran paired stands for itself unpaired too (the breakdown reads `actions`)
    actions = {k: mean(per_action.get(k) or per_paired[k]) for k in {*per_action, *per_paired}}
    paired_actions = {k: mean(v) for k, v in per_paired.items()}
    memory = {k: split[k] for k in CATEGORIES}
    memory["peak"] = peak
    return RoleRun(rank=rank, pp_rank=ctx.coords.pp, memory=memory,
                   model_state={k: live[k] for k in ("params", "grads", "optimizer")}, actions=actions,
                   paired_actions=paired_actions,
                   p2p_s={k: statistics.mean(v) for k, v in p2p.items()}, outside=outside,
                   grad_sync_parts=grad_sync_parts,
                   comm_bytes=dict(out["comm_bytes"]), comm_s=dict(comm_s), comm_bytes_in_actions=dict(inside),
                   flops=sum(o.flops for o in tracker.ops), derated_kernels=derated, op_seconds=op_seconds)
