"""The cost model, as plain functions: a roofline per op and an alpha-beta model per collective.

Op time = max(FLOPs / (peak(dtype) * matmul efficiency), bytes moved / (HBM * memory efficiency)): a
matmul is compute-bound, an element-wise op or a norm is bandwidth-bound, and nothing is free. On a
measured device (profile.py, `--gpu cpu`) a matmul costs what the measured matmul of the same FLOPs took
(small matmuls run far below the peak there) and every op adds the host's per-op overhead (eager
dispatch and autograd, which a GPU hides behind its queue and a CPU cannot).

Collective time (ring algorithms, as NCCL runs them for large messages), with n ranks, the logical bytes
comm.py records (see its docstring) and the group's link (NVLink when every rank of the group sits in
one node of `gpus_per_node` GPUs, the network otherwise):
    all_reduce        2 (n-1) alpha + 2 (n-1)/n * bytes / bw, or NCCL's tree when it is faster (small
                      messages on many ranks): 2 ceil(log2 n) alpha + 2 * bytes / bw
    all_gather        (n-1) alpha + (n-1)/n * bytes / bw          (bytes: the gathered output)
    reduce_scatter    (n-1) alpha + (n-1)/n * bytes / bw          (bytes: the full input)
    all_to_all        (n-1) alpha + (n-1)/n * bytes / bw          (bytes: what this rank sends)
    send / recv       alpha + bytes / bw
    broadcast         (n-1) alpha + bytes / bw
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from parallel3d.planner.hardware import GPU
from parallel3d.planner.host_kernels import CURVE_OF_OP


def op_time(flops: float, nbytes: float, peak_flops: float, gpu: GPU, occupancy: float = 1.0,
            dtype: Optional[torch.dtype] = None, name: str = "") -> float:
    """Roofline time of one op. `occupancy` (0, 1] derates a kernel whose occupancy limits how much of
    the SM it can use (kernel_report's figures). `dtype` and the op's `name` pick a measured curve, and
    the name an attention kernel's measured share of the peak (`GPU.attention_efficiency`), which includes
    what its occupancy costs."""
    curve = _curve(gpu, dtype, name) if flops else None
    measured = (gpu.attention_efficiency or {}).get(name)
    if curve is not None:
        compute = matmul_seconds(flops, curve)
    elif measured is not None:   # an attention kernel at its measured rate on this architecture
        compute = flops / (peak_flops * measured)
    else:
        compute = flops / (peak_flops * gpu.matmul_efficiency * occupancy) if flops else 0.0
    memory = nbytes / (gpu.hbm_bytes_per_s * gpu.memory_efficiency)
    return max(compute, memory) + gpu.op_overhead_s


def queue_seconds(device_s: Sequence[float], host_op_s: float) -> float:
    """Seconds from the first op's issue to the last op's end when the host issues ops `host_op_s` apart
    and the device runs them in order, each as soon as it is issued and the one before it has ended: a
    GPU's stream behind its host. The sum of `device_s` while the kernels outlast their issue (the host
    runs ahead), n * host_op_s (plus the last kernel) when they are shorter: host-bound."""
    return _span([("op", seconds) for seconds in device_s], host_op_s, waits=False)


def _curve(gpu: GPU, dtype: Optional[torch.dtype], name: str):
    """The measured curve of an op: its own (attention) where measured, else the matmul's of its dtype."""
    if not gpu.matmul_curves:
        return None
    name = CURVE_OF_OP.get(name, name)
    if name in gpu.matmul_curves:
        return gpu.matmul_curves[name]
    key = "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"
    return gpu.matmul_curves.get(key)


def matmul_seconds(flops: float, curve: Sequence[tuple[float, float]]) -> float:
    """Seconds of a matmul of `flops` from measured (FLOPs, seconds) points, log-log interpolated; past the
    largest point at its rate, below the smallest at its time (latency-bound)."""
    pts = sorted(curve)
    if flops <= pts[0][0]:
        return pts[0][1]
    for (f0, s0), (f1, s1) in zip(pts, pts[1:]):
        if flops <= f1:
            w = math.log(flops / f0) / math.log(f1 / f0)
            return math.exp(math.log(s0) + w * (math.log(s1) - math.log(s0)))
    f, s = pts[-1]
    return flops * s / f


def collective_seconds(op: str, nbytes: float, ranks: Sequence[int], gpus_per_node: int, gpu: GPU) -> float:
    """One collective over `ranks`: the measured (alpha, beta) of this op where the device has them
    (gloo on this machine), else the group's link."""
    if gpu.collectives and op in gpu.collectives:
        alpha, beta = gpu.collectives[op]
    else:
        alpha, beta = link(ranks, gpus_per_node, gpu)
    return collective_time(op, nbytes, len(ranks), alpha, beta)


def wake_seconds(op: str, compute_since_s: float, gpu: GPU) -> float:
    """The extra a collective costs a rank that arrives from `compute_since_s` seconds of compute since its
    last collective: the measured extra after a long stretch (gpu.comm_wake_s, gloo on this machine), in
    proportion below it. A collective started beside compute pays it too: two ranks starting a 172 KiB
    all-gather after 3 ms of matmul paid 1.3 ms a start on average against 0.4 at the median. Nothing
    where it was not measured (NCCL: a GPU's)."""
    if not gpu.comm_wake_s or gpu.comm_wake_gap_s <= 0:
        return 0.0
    extra = gpu.comm_wake_s.get("send" if op == "recv" else op, 0.0)
    return extra * min(1.0, compute_since_s / gpu.comm_wake_gap_s)


def hidden_share(op: str, gpu: GPU) -> float:
    """The share of a collective started beside compute that hides behind it: all of it where the
    communication has resources of its own (a GPU's copy engines and NCCL's SMs; a CPU with a core to
    spare), else what its threads leave idle (1 - gpu.comm_busy[op]: gloo's threads take a core from the
    ranks' compute while they copy and sum), nothing where that was not measured."""
    if gpu.overlaps_comm:
        return 1.0
    busy = (gpu.comm_busy or {}).get("send" if op == "recv" else op)
    return 0.0 if busy is None else max(0.0, 1.0 - busy)


def spans_nodes(ranks: Sequence[int], gpus_per_node: int) -> bool:
    return len({r // gpus_per_node for r in ranks}) > 1


def link(ranks: Sequence[int], gpus_per_node: int, gpu: GPU) -> tuple[float, float]:
    """(alpha: mean seconds per ring step, beta: bytes/s of the slowest link) for a group of `ranks`.

    A ring over n ranks on k nodes (NCCL orders it node by node) crosses the network k times per round
    and NVLink n - k times, so the per-step latency is the mix; the bandwidth is the network's."""
    nodes = len({r // gpus_per_node for r in ranks})
    if nodes > 1:
        n = len(ranks)
        alpha = (nodes * gpu.network_latency_s + (n - nodes) * gpu.nvlink_latency_s) / n
        return alpha, gpu.network_bytes_per_s * gpu.network_efficiency
    return gpu.nvlink_latency_s, gpu.nvlink_bytes_per_s * gpu.nvlink_efficiency


def collective_time(op: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Seconds for one collective of `nbytes` logical bytes over `n` ranks (formulas in the docstring)."""
    if n <= 1:
        return 0.0
    frac = (n - 1) / n
    if op == "all_reduce":
        ring = 2 * (n - 1) * alpha + 2 * frac * nbytes / beta
        tree = 2 * math.ceil(math.log2(n)) * alpha + 2 * nbytes / beta
        return min(ring, tree)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) * alpha + frac * nbytes / beta
    if op in ("send", "recv"):
        return alpha + nbytes / beta
    if op == "broadcast":
        return (n - 1) * alpha + nbytes / beta
    return alpha + nbytes / beta


def exposed_in_action(marks: Sequence[tuple], host_op_s: float = 0.0) -> float:
    """Seconds an action waits for the collectives it started beside its compute. `marks`, in the order the
    rank meets them: ("op", seconds), ("block", seconds) (what a collective holds the rank for at its call),
    ("start", key, link, seconds) and ("wait", key). The action runs as a stream behind its host (ops issued
    `host_op_s` apart: queue_seconds). A collective hides only behind what runs between its start and its
    wait (ZeRO-3 waits at the next unit for the gather it started one unit earlier, ring attention at the
    next block): it begins once the stream has reached it (NCCL's stream waits for the work queued before
    it) and its link (group) has finished the transfer before, and ends `seconds` later; a wait before then
    holds the stream. What no wait met (a reduction the code follows up once done) may run to the action's
    end. The answer is the action's span with the waits less its span without them:

        stream    ops =====|start k|====== the unit's ops ======|wait k|----|====
        link k             [============= seconds ===================]
    """
    return _span(marks, host_op_s, True) - _span(marks, host_op_s, False)


def _span(marks: Sequence[tuple], host_op_s: float, waits: bool) -> float:
    """The span of `marks` (exposed_in_action's) as a stream behind its host; `waits=False` leaves out the
    overlapped transfers and their waits (queue_seconds: ops alone)."""
    host = stream = 0.0
    free, ends = {}, {}
    for mark in marks:
        if mark[0] == "op":
            host += host_op_s
            stream = max(stream, host) + mark[1]
        elif mark[0] == "block":
            stream = max(stream, host) + mark[1]
        elif not waits:
            continue
        elif mark[0] == "start":
            _, key, link, seconds = mark
            ends[key] = free[link] = max(stream, free.get(link, 0.0)) + seconds
        elif mark[1] in ends:
            stream = max(stream, ends.pop(mark[1]))
    return max(stream, max(ends.values(), default=0.0))


def exposed_buckets(parts: Sequence[float], backward_s: float) -> float:
    """What is left of the bucketed gradient reductions (`parts`: seconds per reduction, in launch order)
    behind the backward they overlap. A bucket's reduction cannot start before backward has produced its
    gradients (bucket i is ready once the share of the backward up to and including it has run, taking
    seconds as the measure of size) nor before the previous one ends (one link): the last bucket's
    reduction always follows the backward, and one bucket hides nothing."""
    total = sum(parts)
    if total <= 0:
        return 0.0
    done, ready = 0.0, 0.0
    for part in parts:
        ready += backward_s * part / total
        done = max(done, ready) + part
    return max(0.0, done - backward_s)
