"""Asynchronous collectives for gradient/parameter buckets, with the same accounting as `comm`.

`comm` offers blocking collectives; overlapping a bucket's reduction with the rest of the backward pass
needs `async_op=True` handles. These helpers record bytes exactly like `comm` does (all_reduce: tensor
bytes; reduce_scatter: bytes of the full input; all_gather: bytes of the full output) so that
`ctx.stats.summary()` keeps one convention for every op. A group of size 1 moves nothing and records
nothing; the helpers then return None (there is nothing to wait for).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from parallel3d.comm import CollectiveError, Group


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _start(group: Group, op: str, nbytes: int, fn) -> Optional[dist.Work]:
    group._record(op, nbytes)
    try:
        return fn()
    except RuntimeError as e:
        raise CollectiveError(f"{op} on {group.name} group (ranks {group.ranks}) failed on rank "
                              f"{group.global_rank}: {e}") from e


def start_all_reduce(t: torch.Tensor, group: Group) -> Optional[dist.Work]:
    """In-place sum over the group; returns the work handle (None for size 1)."""
    if group.size == 1:
        return None
    return _start(group, "all_reduce", _nbytes(t),
                  lambda: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group.pg, async_op=True))


def start_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group) -> Optional[dist.Work]:
    """out (n,) <- this rank's n-element block of the sum over ranks of inp (size * n,)."""
    if group.size == 1:
        out.copy_(inp)
        return None
    return _start(group, "reduce_scatter", _nbytes(inp),
                  lambda: dist.reduce_scatter_single(out, inp, group=group.pg, async_op=True))


def start_all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group) -> Optional[dist.Work]:
    """out (size * n,) <- every rank's inp (n,), in group-rank order."""
    if group.size == 1:
        out.copy_(inp)
        return None
    return _start(group, "all_gather", _nbytes(out),
                  lambda: dist.all_gather_single(out, inp, group=group.pg, async_op=True))


def wait(work: Optional[dist.Work], group: Group, op: str) -> None:
    if work is None:
        return
    try:
        work.wait()
    except RuntimeError as e:
        raise CollectiveError(f"{op} on {group.name} group (ranks {group.ranks}) failed on rank "
                              f"{group.global_rank}: {e}") from e


def clone_group(group: Group, key: str, ctx) -> Group:
    """A Group with the same ranks, name and accounting but its own process group.

    ZeRO-3 issues parameter all-gathers (in a fixed forward/backward order) and gradient reduce-scatters
    (when buckets become ready) on the same ranks. On one process group the two streams would have to be
    issued in the same interleaving on every rank; on separate groups each stream only has to be ordered
    consistently by itself, and gloo/NCCL can also run them concurrently. Creating a group is collective
    over the whole world, so every rank builds the clones of every group of that kind, in spec order. The
    clones are cached on the context (`ctx._dp_clones`) so repeated optimizers do not leak groups.
    """
    if group.size == 1 or not dist.is_initialized():
        return group
    cache = ctx.__dict__.setdefault("_dp_clones", {})
    if key not in cache:
        built = {}
        for ranks in ctx.spec.groups(key):
            pg = dist.new_group(ranks)
            if ctx.rank in ranks:
                built = Group(group.name, list(ranks), ctx.rank, pg, ctx.stats)
        cache[key] = built
    return cache[key]
