"""Small collectives the checkpoint code needs, built on `comm` (no pickle, no object collectives).

Checkpoint saving and loading must never leave some ranks waiting in a collective while another rank has
failed: every phase ends with `agree_on_errors`, an all-gather of each rank's error message (or nothing),
after which either every rank continues or every rank raises the same CheckpointError. JSON travels as
uint8 tensors so the same code works on gloo (CPU) and NCCL (CUDA tensors).
"""
from __future__ import annotations

import hashlib
from typing import Optional, Sequence

import torch

from parallel3d import comm
from parallel3d.checkpoint.store import CheckpointError
from parallel3d.comm import all_gather_varlen, all_gather_json


def agree_on_errors(error: Optional[str], group: comm.Group, device: Optional[torch.device] = None,
                    what: str = "checkpoint") -> None:
    """Raise CheckpointError on every rank if any rank reports an error (the lowest failing rank's message)."""
    errors = all_gather_json(error, group, device)
    failed = [(r, e) for r, e in zip(group.ranks, errors) if e]
    if failed:
        rank, message = failed[0]
        more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
        prefix = "" if group.size == 1 else f"rank {rank}{more}: "
        raise CheckpointError(f"{what} failed: {prefix}{message}")


def entry_key(name: str, slices: Sequence[slice]) -> int:
    """A 63-bit fingerprint of (tensor name, slices): equal keys on two ranks mean replicas of the same data."""
    text = name + "|" + ",".join(f"{s.start}:{s.stop}" for s in slices)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & ((1 << 63) - 1)


def first_holders(keys: Sequence[int], group: comm.Group, device: Optional[torch.device] = None) -> list[bool]:
    """For each of this rank's keys: True when no lower rank holds the same key (this rank writes it).

    This is the dedup rule of the checkpoint: a slice replicated over dp/tp/embedding groups (or, for
    optimizer state, wherever the optimizer replicates it) is written by its lowest-ranked holder only,
    whatever the layout or ZeRO stage, at the cost of one all-gather of 8 bytes per local tensor."""
    if group.size == 1:
        return [True] * len(keys)
    device = device or torch.device("cpu")
    mine = torch.tensor(list(keys), dtype=torch.int64)
    lower: set[int] = set()
    for r, t in enumerate(all_gather_varlen(mine, group, device)):
        if r == group.rank:
            break
        lower.update(t.tolist())
    return [k not in lower for k in keys]
