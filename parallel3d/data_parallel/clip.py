"""Global gradient norm, overflow detection and clipping -- exact across every kind of shard (the AdamW
update on the held shard is in adamw.py).

After gradient reduction each rank holds, per bucket, the reduced gradient of its segment (ZeRO >= 1)
or of the whole bucket (ZeRO-0). A gradient element is counted by exactly one rank:
  * ZeRO >= 1: the rank whose segment holds the element (segments partition each bucket over DP x CP /
    expert-DP, a parameter straddling segments counts on each rank for its own range; under HSDP they
    partition a shard group, and only replica 0 of the shard counts);
    ZeRO-0: DP x CP (or expert-DP) rank 0, the others hold identical copies;
  * the first rank (rank 0) of every group in `meta.replicated` (TP-replicated norms, the tied
    embedding copy on the last pipeline stage);
  * vocabulary padding rows are skipped; TP-split, PP stages and expert (EP x ETP) shards are disjoint
    slices held by different ranks, so summing over the world counts them once.
Each rank sums the squares it owns; one all-reduce over the world of [sum of squares, non-finite flag]
gives the exact global norm and a consistent skip decision (the flag scans every element a rank holds,
owned or not, so a replica that alone went non-finite still makes every rank skip).
"""
from __future__ import annotations

import math

import torch

from parallel3d import comm
from parallel3d.data_parallel.buffer import Bucket, Slot
from parallel3d.host_sync import read_list
from parallel3d.mesh import ParallelContext


def counts_once(b: Bucket, s: Slot, ctx: ParallelContext, zero: int) -> bool:
    """Whether this rank is the one that counts (and checkpoints) its held rows of `s`."""
    if s.local_copy:  # its source on this same rank counts (and checkpoints) the shared rows
        return False
    if zero == 0 and b.group.rank != 0:
        return False
    if b.replica is not None and b.replica.rank != 0:   # HSDP: the replicas of a shard hold the same rows
        return False
    for name in s.meta.replicated:
        g = getattr(ctx, name)  # None: this rank is outside that group (embedding)
        if g is not None and g.rank != 0:
            return False
    return True


def held(b: Bucket, s: Slot) -> int:
    """Real (not vocabulary padding) elements of `s` in this rank's segment (buffer.py: Slot.h_*)."""
    return s.h_real


NOMINAL_NORM = 1e12  # a dry run's gradient norm (grad_stats)


@torch.no_grad()
def grad_stats(buckets: list[Bucket], ctx: ParallelContext, zero: int, inv_scale: float) -> tuple[float, bool]:
    """Unscale the held gradients in place; return (global L2 norm, any non-finite anywhere).

    One fused pass unscales and flags non-finite values (torch's AMP kernel); per-parameter norms are
    fp32 (as torch.nn.utils.clip_grad_norm_) and their squares are summed in fp64."""
    grads = [b.grad.shard for b in buckets]
    dev = grads[0].device if grads else ctx.device   # optimizer offload: the held gradients are on the host
    found = torch.zeros(1, dtype=torch.float32, device=dev)
    if grads:
        inv = torch.full((1,), inv_scale, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
    norms = []
    for b in buckets:
        for s in b.slots:
            if held(b, s) and counts_once(b, s, ctx, zero):
                norms.append(torch.linalg.vector_norm(s.held(b.grad.shard), dtype=torch.float32))
    sumsq = torch.stack(norms).double().square().sum() if norms else torch.zeros((), dtype=torch.float64,
                                                                                    device=dev)
    stats = torch.stack([sumsq, found[0].double()]).to(ctx.device)
    comm.all_reduce(stats, ctx.world)
    # one host sync: norm and flag. A dry run has no values: its nominal norm exceeds any train.grad_clip, so
    # it takes (and the planner prices) the clipping pass, as a run does whenever the norm is above the clip
    total, flag = read_list(stats, ctx.stats.syncs, "step", [NOMINAL_NORM ** 2, 0.0])
    bad = flag > 0
    norm = math.sqrt(total) if math.isfinite(total) else float("nan")
    return norm, bad or not math.isfinite(norm)


@torch.no_grad()
def clip_(buckets: list[Bucket], norm: float, max_norm: float):
    """Scale every held gradient by max_norm / (norm + 1e-6) when that is < 1 (torch's convention).
    Returns the factor applied (None: none), which offloaded host copies of the gradients replay."""
    coef = max_norm / (norm + 1e-6)
    if coef < 1.0:
        for b in buckets:
            b.grad.shard.mul_(coef)
        return coef
    return None
