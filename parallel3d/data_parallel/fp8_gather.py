"""ZeRO-3 parameter all-gathers in fp8 (parallel.zero3_fp8_gather, with train.fp8=tensorwise|rowwise).

A weight the fp8 linears consume (tagged `weight.fp8` by convert_to_fp8) is quantised to e4m3 on its owner's
shard (on CUDA by the fused cast pass of kernels/fp8_cast.py: dispatch.fp8_scale_cast) and travels as 1
byte per value instead of bf16's 2; the GEMMs take the gathered bytes and inverse scale as they are
(tensor_parallel/fp8.py `_weight8`). The scale must be the one the unsharded quantisation would use, so
the bytes are *identical* to quantising the gathered bf16 weight, and training is bit-for-bit the run
without fp8 gathers:

    tensorwise  scale = fp8_max / amax(W): every rank's shard amax, MAX all-reduced over the shard group
                (one small all-reduce per bucket; torchao's float8 all-gather for FSDP2 does the same),
                then over TP where TP splits the weight. One copy serves forward (y) and backward (dx).
    rowwise     forward: one scale per output row (amax over `in`). ZeRO-3 shards by whole rows
                (buffer.py), so a shard's rows carry their own scales (MAX over TP for a row-parallel weight,
                whose `in` is TP-split); the fp32 row scales are gathered with the bytes.
                backward (dx = dy @ W contracts over `out`): one scale per column (amax over `out`, which
                spans the shards): the shards' column amaxes are MAX all-reduced (shard group, then TP for
                a column-parallel weight), every rank knows them, only the bytes travel.
                A forward recomputed inside backward would need the row copy, which the backward gather does
                not bring: rowwise is refused with activation checkpointing.

Every other parameter of the bucket (norms, biases, replicated KV heads) is gathered in the compute dtype
in a second all-gather. The gathered fp8 weight is not written into the parameter: its bf16 storage stays
freed (half the gathered memory too) and the copy lives in `weight.fp8.gathered` until the unit is freed.
Bytes on the wire per gather (this rank's receive buffer, N ranks, segment S of which E fp8 elements):
N * (E + 2 (S - E)) plus, rowwise forward, 4 bytes per gathered row.
"""
from __future__ import annotations

from typing import Iterable, Optional

import torch

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.data_parallel.buffer import Bucket, Slot
from parallel3d.kernels.dispatch import fp8_scale_cast  # the fused cast pass on CUDA (kernels/fp8_cast.py)
from parallel3d.tensor_parallel.fp8 import E4M3, weight_axes, weight_reduce_group


def check_fp8_gather(enabled: bool, zero: int, fp8: str, quantized_weights: bool, hpz: bool,
                     activation_checkpointing: str) -> None:
    """parallel.zero3_fp8_gather: ZeRO-3's gathers of the fp8 linears' weights (needs both)."""
    if not enabled:
        return
    if zero != 3 or fp8 == "none":
        raise ValueError(f"parallel.zero3_fp8_gather gathers ZeRO-3 parameters in fp8 for the fp8 linears: it needs "
                         f"parallel.zero=3 and train.fp8=tensorwise|rowwise (got zero={zero}, fp8={fp8})")
    if quantized_weights or hpz:
        raise ValueError("parallel.zero3_fp8_gather replaces the ZeRO-3 weight gather; it cannot be combined with "
                         "parallel.zero_quantized_weights or parallel.zero_hpz")
    if fp8 == "rowwise" and activation_checkpointing != "none":
        raise ValueError("parallel.zero3_fp8_gather with train.fp8=rowwise: the backward gather brings only the "
                         "column-scaled copy, which a recomputed forward cannot use; set "
                         "train.activation_checkpointing=none or train.fp8=tensorwise")


def fp8_recipe(params: Iterable[torch.nn.Parameter]) -> str:
    """The recipe of the fp8 linears among the trainable `params` (convert_to_fp8 tags their weights);
    "none": there are none."""
    return next((p.fp8.recipe for p in params if p.requires_grad and getattr(p, "fp8", None) is not None
                 and p.fp8.recipe != "none"), "none")


def fp8_slots(b: Bucket) -> list[Slot]:
    """The slots of `b` whose weights the fp8 linears consume."""
    return [s for s in b.slots if getattr(s.param, "fp8", None) is not None and s.param.fp8.recipe != "none"]


def _max_reduce(vals: list[torch.Tensor], groups: list[Optional[Group]]) -> list[torch.Tensor]:
    """MAX all-reduce each tensor over its group: one collective per distinct group, tensors concatenated."""
    out = list(vals)
    for g in {id(g): g for g in groups if g is not None}.values():
        idx = [i for i, h in enumerate(groups) if h is g]
        flat = comm.all_reduce(torch.cat([vals[i].reshape(-1) for i in idx]), g, op="max")
        for i, part in zip(idx, flat.split([vals[i].numel() for i in idx])):
            out[i] = part.view(vals[i].shape)
    return out


def _rows(got: torch.Tensor, o: int, s: Slot, n: int) -> torch.Tensor:
    """The slot's rows from a gathered (N, width) buffer whose columns [o, o + chunk) hold its chunk."""
    return got[:, o: o + s.chunk_numel].reshape((n * s.chunk_rows,) + s.shape[1:])[: s.rows]  # (rows, ...)


@torch.no_grad()
def fp8_all_gather(b: Bucket, shard: torch.Tensor, full: torch.Tensor, slots: list[Slot], group: Group,
                   backward: bool) -> None:
    """Gather bucket `b` from every rank's `shard` (S,): `slots`' weights in fp8 into their `fp8.gathered`,
    the other slots into `full` (N*S,) rank-major (for copy_rows_out)."""
    n, ids = b.nshard, {id(s) for s in slots}
    rest = [s for s in b.slots if id(s) not in ids]
    if rest:                                           # compute-dtype part, one gather
        got = comm.all_gather(torch.cat([s.flat(shard) for s in rest]), group).view(n, -1)   # (N, R)
        o, fullv = 0, full.view(n, b.seg)
        for s in rest:
            fullv[:, s.offset: s.offset + s.chunk_numel].copy_(got[:, o: o + s.chunk_numel])
            o += s.chunk_numel
    axes = weight_axes(slots[0].param.fp8.recipe, backward)
    for axis in axes:
        local = [s.rows_view(shard) for s in slots]                                # (c, in) each, zero padded
        amax = [w.abs().amax().float() if axis is None else w.abs().amax(1, keepdim=True).float() if axis == 1
                else w.abs().amax(0, keepdim=True).float() for w in local]          # (), (c, 1) or (1, in)
        if axis != 1:                                 # the reduced dimension spans the shards
            amax = _max_reduce(amax, [group] * len(amax))
        amax = _max_reduce(amax, [weight_reduce_group(s.param.fp8.kind, s.param.fp8.group, axis) for s in slots])
        q = [fp8_scale_cast(w, a, E4M3, axis) for w, a in zip(local, amax)]         # (c, in) e4m3, inverse scales
        got8 = comm.all_gather(torch.cat([t.reshape(-1) for t, _ in q]).view(torch.uint8), group).view(n, -1)
        if axis == 1:                                  # row scales live with their rows
            inv_all = comm.all_gather(torch.cat([inv.reshape(-1) for _, inv in q]), group).view(n, -1)
        o = r = 0
        for s, (_, inv) in zip(slots, q):
            w8 = _rows(got8, o, s, n).contiguous().view(E4M3)                       # (out, in)
            if axis == 1:
                inv = inv_all[:, r: r + s.chunk_rows].reshape(-1)[: s.rows].reshape(s.rows, 1)  # (out, 1)
            s.param.fp8.gathered[axis] = (w8, inv)
            o, r = o + s.chunk_numel, r + s.chunk_rows


def drop(slots: list[Slot]) -> None:
    for s in slots:
        s.param.fp8.gathered.clear()
