"""The cost model, as plain functions: a roofline per op and an alpha-beta model per collective.

Op time = max(FLOPs / (peak(dtype) * matmul efficiency), bytes moved / (HBM * memory efficiency)): a
matmul is compute-bound, an element-wise op or a norm is bandwidth-bound, and nothing is free.

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
from typing import Sequence

from parallel3d.planner.hardware import GPU


def op_time(flops: float, nbytes: float, peak_flops: float, gpu: GPU, occupancy: float = 1.0) -> float:
    """Roofline time of one op. `occupancy` (0, 1] derates a kernel whose occupancy limits how much of
    the SM it can use (kernel_report's figures)."""
    compute = flops / (peak_flops * gpu.matmul_efficiency * occupancy) if flops else 0.0
    memory = nbytes / (gpu.hbm_bytes_per_s * gpu.memory_efficiency)
    return max(compute, memory)


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


def exposed(comm_s: float, overlap_with_s: float) -> float:
    """What is left of `comm_s` seconds of communication hidden behind `overlap_with_s` of compute."""
    return max(0.0, comm_s - overlap_with_s)
