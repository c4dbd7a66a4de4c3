"""Process-group clones for ZeRO-3 (the asynchronous collectives themselves live in `parallel3d.comm`)."""
from __future__ import annotations

import torch.distributed as dist

from parallel3d.comm import Group


def clone_group(group: Group, key: str, ctx) -> Group:
    """A Group with the same ranks, name and accounting but its own process group.

    ZeRO-3 issues parameter all-gathers (in a fixed forward/backward order) and gradient reduce-scatters
    (when buckets become ready) on the same ranks. On one process group the two streams would have to be
    issued in the same interleaving on every rank; on separate groups each stream only has to be ordered
    consistently by itself, and gloo/NCCL can also run them concurrently. Creating a group is collective
    over the whole world, so every rank builds the clones of every group of that kind, in spec order. The
    clones are cached on the context (`ctx._dp_clones`) so repeated optimizers do not leak groups.
    """
    if group.size == 1 or group.simulated or not dist.is_initialized():
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
