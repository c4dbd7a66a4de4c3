"""Helpers built on the collectives: gathers of uneven or JSON payloads, the differentiable all-to-all."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from parallel3d.comm.collectives import all_gather, all_to_all
from parallel3d.comm.group import Group
from parallel3d.host_sync import read_list, read_tensor, upload


def even_split(total: int, parts: int) -> list[int]:
    """`total` items over `parts` as evenly as possible (the dry run's balanced routing)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def all_gather_varlen(data: torch.Tensor, group: Group, device: torch.device, category: str = "logging"
                      ) -> list[torch.Tensor]:
    """All-gather 1-D tensors of different lengths: lengths first, then the payloads padded to the longest.
    Two host syncs (the lengths, the payloads), counted under `category` (parallel3d.host_sync)."""
    if group.size == 1:
        return [data]
    syncs = group.stats.syncs if group.stats is not None else None
    length = torch.full((1,), data.numel(), dtype=torch.int64, device=device)
    lengths = read_list(all_gather(length, group), syncs, category, [data.numel()] * group.size)
    padded = torch.zeros(max(max(lengths), 1), dtype=data.dtype, device=device)
    padded[: data.numel()] = upload(data, device)
    everyone = read_tensor(all_gather(padded, group).view(group.size, -1), syncs, category)  # on the host
    return [everyone[r, :n] for r, n in enumerate(lengths)]


def all_gather_json(obj: object, group: Group, device: Optional[torch.device] = None, category: str = "logging"
                    ) -> list:
    """Every rank's JSON-able `obj`, in group-rank order (size 1: `[obj]`, no communication). JSON travels
    as uint8 tensors on `device` (NCCL needs device tensors): no pickle, no object collectives."""
    import json

    if group.size == 1:
        return [obj]
    device = device or group.device or torch.device("cpu")
    raw = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    return [json.loads(bytes(t.tolist()).decode()) for t in all_gather_varlen(raw, group, device, category)]


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad.contiguous(), ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all_autograd(x: torch.Tensor, group: Group, out_splits: Optional[Sequence[int]] = None,
                        in_splits: Optional[Sequence[int]] = None) -> torch.Tensor:
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group, out_splits, in_splits)
