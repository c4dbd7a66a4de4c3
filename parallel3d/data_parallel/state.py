"""Optimizer state for checkpoints, reduced gradients for tests, and measured memory.

state_tensors representation (exact and rectangular):
    "master/<name>", "exp_avg/<name>", "exp_avg_sq/<name>" -> (fp32 data, global shape, global slices)
    (train.optimizer=muon: "master/<name>", "momentum/<name>" for the matrices Muon updates; slot_kinds)
and, where a rank's piece of a parameter is not one rectangle, further pieces "<kind>/<name>#1", "#2", ...
(the checkpoint writes them as more shards of the same tensor; see `piece_name`). A rank holds a flat element
range [h_param, h_param + h_real) of the TP-local tensor (buffer.py): under the contiguous layout (ZeRO-1/2)
it may start and end inside rows, so it is cut into at most 2*ndim - 1 boxes (`boxes`: a partial innermost
run, partial rows, whole rows, ...), each a global slice (meta.slices shifted); under the rows layout (ZeRO-3,
ZeRO-0) it is whole rows, one box, as before. Without ZeRO a rank holds the whole TP-local tensor. Every
element of every global tensor is returned by exactly one rank in the world (the rule of clip.counts_once:
ZeRO-0 only on DP x CP / expert-DP rank 0, replicas in meta.replicated only on their group's rank 0), so the
pieces of all ranks tile each tensor exactly, and a checkpoint written under one layout (any tp/pp/dp/zero,
per-row pieces of older versions included) can be read back under another through `read(name, slices)`.
Entries are live views (under NVMe offload: copies read from the files); copy before mutating.
"""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from parallel3d.data_parallel.buffer import Bucket, Slot
from parallel3d.data_parallel.clip import counts_once, held
from parallel3d.mesh import ParallelContext

KINDS = ("master", "exp_avg", "exp_avg_sq")
MUON_KINDS = ("master", "momentum")   # train.optimizer=muon's matrix slots: the momentum lives in exp_avg
STORAGE = {"master": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum": "exp_avg"}
PIECE = "#"


def slot_kinds(s: Slot, kinds: Sequence[str] = KINDS) -> tuple[str, ...]:
    """The state kinds a slot keeps, of those asked for: AdamW's, or Muon's master and momentum (a
    checkpoint of the other optimizer then lacks a tensor: checkpoint/load.py names it, never a silent
    load of Adam's m as Muon's momentum). Asking for every AdamW kind asks for Muon's momentum too."""
    if not s.muon:
        return tuple(k for k in KINDS if k in kinds)
    return tuple(k for k in MUON_KINDS if k in kinds or (k == "momentum" and "exp_avg" in kinds))


def piece_name(key: str, i: int) -> str:
    """Key of a rank's i-th box of one tensor: the key itself for the first, "<key>#<i>" after it."""
    return key if i == 0 else f"{key}{PIECE}{i}"


def base_name(key: str) -> str:
    """The tensor a piece key belongs to ("master/w#2" -> "master/w")."""
    return key.split(PIECE, 1)[0]


def boxes(shape: Sequence[int], start: int, stop: int) -> Iterator[tuple[int, int, tuple[slice, ...]]]:
    """The flat range [start, stop) of a C-contiguous tensor of `shape` as rectangular boxes, in order:
    (flat start, flat stop, slices). A range of whole rows is one box."""
    if start >= stop:
        return
    if len(shape) == 1:
        yield start, stop, (slice(start, stop),)
        return
    inner = 1
    for n in shape[1:]:
        inner *= n

    def in_row(a: int, e: int):   # [a, e) inside one row r: that row's boxes, one dimension down
        r = a // inner
        for x, y, sl in boxes(shape[1:], a - r * inner, e - r * inner):
            yield x + r * inner, y + r * inner, (slice(r, r + 1),) + sl

    if start % inner:                                # the end of a partial first row
        head = min(stop, (start // inner + 1) * inner)
        yield from in_row(start, head)
        start = head
    r0, r1 = start // inner, stop // inner
    if r1 > r0 and start < stop:                     # whole rows
        yield r0 * inner, r1 * inner, (slice(r0, r1),) + tuple(slice(0, n) for n in shape[1:])
    if stop > max(start, r1 * inner):                # the start of a partial last row
        yield from in_row(max(start, r1 * inner), stop)


def held_boxes(s: Slot) -> Iterator[tuple[int, int, tuple[slice, ...], tuple[int, ...]]]:
    """The real elements this rank holds of `s`, as (start, stop in the held segment, global slices, box
    shape); a 0-d parameter is one box with no slices."""
    if s.scalar:
        if s.h_real:
            yield s.h_seg, s.h_seg + 1, (), ()
        return
    g0 = [sl.start for sl in s.meta.slices]
    for a, e, sl in boxes(s.shape, s.h_param, s.h_param + s.h_real):
        yield (s.h_seg + a - s.h_param, s.h_seg + e - s.h_param,
               tuple(slice(x.start + o, x.stop + o) for x, o in zip(sl, g0)), tuple(x.stop - x.start for x in sl))


def _state_part(b: Bucket, kind: str, a: int, e: int) -> torch.Tensor:
    """Elements [a, e) of the held segment of one kind of Adam state (read from the files on NVMe)."""
    if b.adam.home is None:
        return b.adam.second_moment(a, e) if kind == "exp_avg_sq" else getattr(b.adam, STORAGE[kind])[a:e]
    return b.adam.home.read_rows(kind, b, a, e - a)


def state_tensors(buckets: Sequence[Bucket], ctx: ParallelContext, zero: int) -> dict:
    out = {}
    for b in buckets:
        for s in b.slots:
            if not held(b, s) or not counts_once(b, s, ctx, zero):
                continue
            for i, (a, e, slices, shape) in enumerate(held_boxes(s)):
                for kind in slot_kinds(s):
                    out[piece_name(f"{kind}/{s.name}", i)] = (_state_part(b, kind, a, e).view(shape),
                                                              s.meta.global_shape, slices)
    return out


@torch.no_grad()
def load_state_tensors(buckets: Sequence[Bucket], read: Callable, kinds: tuple[str, ...] = KINDS) -> None:
    """Fill every held element (replicas included) from read(name, global slices). The caller then
    refreshes the model parameters from the master weights."""
    for b in buckets:
        for s in b.slots:
            for a, e, slices, _ in held_boxes(s):
                for kind in slot_kinds(s, kinds):
                    data = read(f"{kind}/{s.name}", slices)
                    if b.adam.home is not None:
                        b.adam.home.write_rows(kind, b, a, data)
                    else:
                        _state_part(b, kind, a, e).copy_(data.reshape(-1))


def grad_slices(buckets: Sequence[Bucket], inv_scale: float) -> dict:
    """name (or piece key, `piece_name`) -> (reduced gradient this rank holds times inv_scale, global slices,
    global shape). Call after the gradient sync (before clipping/step); the format of
    tests/parity.local_slices (tests/parity.assemble joins the pieces)."""
    out = {}
    for b in buckets:
        for s in b.slots:
            for i, (a, e, slices, shape) in enumerate(held_boxes(s)):
                out[piece_name(s.name, i)] = (b.grad.shard[a:e].float().view(shape) * inv_scale, slices,
                                              s.meta.global_shape)
    return out


def state_by_category(buckets: Sequence[Bucket], params: Sequence[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """The model-state tensors allocated right now, per category (a storage may appear under several; the
    first category in order params, grads, optimizer owns it):

    params: model parameters (0 while ZeRO-3 has them freed) + ZeRO-3's persistent shards;
    grads: accumulation buffers, reduced shards, reductions in flight, stray .grad;
    optimizer: fp32 master weights (unless they are the parameters: fp32 without ZeRO / ZeRO-3) + Adam m, v.
    """
    bs = buckets
    found = {"params": [p.data for p in params] + [b.param_flat for b in bs],
             "grads": [t for b in bs for t in (b.grad.full, b.grad.shard, b.grad.out)] + [p.grad for p in params],
             "optimizer": [t for b in bs for t in (b.adam.master, b.adam.exp_avg, b.adam.exp_avg_sq)]}
    return {k: [t for t in v if t is not None] for k, v in found.items()}


def memory_bytes(buckets: Sequence[Bucket], params: Sequence[torch.Tensor]) -> dict[str, int]:
    """Bytes of the tensor storages allocated right now per category of `state_by_category`, each storage
    counted once (first category wins)."""
    seen: set = set()
    out = {}
    for category, tensors in state_by_category(buckets, params).items():
        total = 0
        for t in tensors:
            st = t.untyped_storage()  # storages keep their Python identity (data_ptr is 0 on meta)
            if st.nbytes() and st not in seen:
                seen.add(st)
                total += st.nbytes()
        out[category] = total
    return out
