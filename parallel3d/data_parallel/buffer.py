"""Flat gradient buckets in rank-major shard layout.

A bucket holds whole parameters that share one reduction group (dense: DP x CP; expert: expert-DP).
With N shards (N = group size under ZeRO, N = 1 without) each parameter is cut along dim 0 into N chunks
of c = ceil(rows / N) rows, and chunk k of every parameter lives in segment k of the bucket:

    bucket, N * S elements (S = sum of chunk sizes c * row_numel)
    ┌──────── segment 0 (rank 0) ─────────┬──────── segment 1 (rank 1) ─────────┐
    │ A rows [0, cA) │ B rows [0, cB)     │ A rows [cA, 2cA) │ B rows [cB, rows)░ │  ░ zero padding
    └────────────────┴────────────────────┴──────────────────┴────────────────────┘
      offset oA = 0    offset oB = cA*nA    (the same offsets in every segment)

Why rank-major: a reduce-scatter of the bucket leaves rank r holding segment r, i.e. rows
[r*c, (r+1)*c) of every parameter -- a rectangular dim-0 slice. Optimizer state (master weights, Adam m
and v) is kept per segment, so each rank's share of every tensor is an exact global slice, which is what
checkpoints store (`DistributedOptimizer.state_tensors`). A Megatron-style param-contiguous buffer would
cut parameters at arbitrary flat offsets instead. The price: a parameter's chunks are not adjacent, so
`param.grad` cannot be a view of the buffer; autograd's grad is added into it by a post-accumulate hook
(two strided adds per parameter) and gathered parameters are copied out (as FSDP2 does). With N = 1
the layout is simply param-contiguous and parameters can be views of a flat parameter buffer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from parallel3d.comm import Group
from parallel3d.params import ParamMeta


@dataclass
class Slot:
    """One parameter inside a bucket."""
    name: str
    param: nn.Parameter
    shape: tuple[int, ...]   # local (TP-local, padded) shape; a 0-d parameter is treated as (1,)
    rows: int                # shape[0]
    row_numel: int           # elements per row
    chunk_rows: int          # c = ceil(rows / N)
    offset: int = 0          # start of this parameter's chunk inside every segment
    decay: bool = True
    real_rows: int = 0       # rows without vocabulary padding (meta.local_real_shape[0])
    scalar: bool = False     # the parameter is 0-d
    local_copy: bool = False  # a tied copy whose source is on this rank too (V pipeline placement)

    @property
    def meta(self) -> ParamMeta:
        return self.param.meta

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    def valid_rows(self, k: int) -> int:
        """Rows of the parameter held in segment k (the last chunks may be short or empty)."""
        return max(0, min(self.chunk_rows, self.rows - k * self.chunk_rows))

    def real_rows_in(self, k: int) -> int:
        """Rows of segment k that are real (not vocabulary padding)."""
        return max(0, min(self.valid_rows(k), self.real_rows - k * self.chunk_rows))

    def flat(self, segment: torch.Tensor) -> torch.Tensor:
        """This parameter's chunk in a flat segment tensor (S,), 1-D."""
        return segment[self.offset: self.offset + self.chunk_numel]

    def rows_view(self, segment: torch.Tensor) -> torch.Tensor:
        """The chunk as (chunk_rows, *row shape)."""
        return self.flat(segment).view((self.chunk_rows,) + self.shape[1:])

    def global_slices(self, k: int, nrows: int) -> tuple[slice, ...]:
        """Global slices of local rows [k*c, k*c + nrows)."""
        if self.scalar:
            return ()
        sl = self.meta.slices
        r0 = sl[0].start + k * self.chunk_rows
        return (slice(r0, r0 + nrows),) + tuple(sl[1:])


def make_slot(name: str, p: nn.Parameter, nshard: int, decay: bool) -> Slot:
    shape = tuple(p.shape) if p.dim() > 0 else (1,)
    meta: ParamMeta = p.meta
    real = meta.local_real_shape if p.dim() > 0 else (1,)
    if tuple(real[1:]) != shape[1:]:
        raise ValueError(f"parameter {name}: padding is only supported along dim 0 (local shape {shape}, "
                         f"real shape {real})")
    rows = shape[0]
    row_numel = 1
    for n in shape[1:]:
        row_numel *= n
    return Slot(name, p, shape, rows, row_numel, -(-rows // nshard), decay=decay, real_rows=real[0],
                scalar=p.dim() == 0)


def add_rows(full: torch.Tensor, seg: int, nshard: int, slot: Slot, src: torch.Tensor) -> None:
    """full (N*S,) rank-major  +=  src (rows, ...) laid out chunk k -> segment k."""
    _rows_op(full, seg, nshard, slot, src.reshape(-1), "add")


def copy_rows_out(full: torch.Tensor, seg: int, nshard: int, slot: Slot, dst: torch.Tensor) -> None:
    """dst (rows, ...)  <-  the chunks of `slot` in full (N*S,) rank-major. dst must be contiguous."""
    _rows_op(full, seg, nshard, slot, dst.view(-1), "out")


def _rows_op(full: torch.Tensor, seg: int, nshard: int, slot: Slot, flat: torch.Tensor, op: str) -> None:
    c, rn = slot.chunk_rows, slot.row_numel
    n_full = min(nshard, slot.rows // c)          # chunks holding exactly c rows
    base = full.storage_offset() + slot.offset
    if n_full:
        strided = full.as_strided((n_full, c * rn), (seg, 1), base)
        dense = flat[: n_full * c * rn].view(n_full, c * rn)
        if op == "add":
            strided.add_(dense)
        else:
            dense.copy_(strided)
    rem = slot.rows - n_full * c                   # rows of the one short chunk, if any
    if rem > 0:
        start = n_full * seg + slot.offset
        part, tail = full[start: start + rem * rn], flat[n_full * c * rn:]
        if op == "add":
            part.add_(tail)
        else:
            tail.copy_(part)


@dataclass
class GradSync:
    """A bucket's gradient state machine for one optimizer step: accumulate -> ready -> launched -> reduced."""
    full: Optional[torch.Tensor] = None     # (N*S,) accumulation buffer
    shard: Optional[torch.Tensor] = None    # (S,) reduced segment (ZeRO-2/3) -- a view of `full` for ZeRO-0/1
    out: Optional[torch.Tensor] = None      # reduce-scatter output in flight
    work: object = None                     # the reduction's work handle
    count: int = 0                          # gradients arrived during the step's last backward
    ready: bool = False
    launched: bool = False
    replicating: bool = False               # HSDP: the reduced segment is being summed across replicas


@dataclass
class AdamState:
    """fp32 optimizer state of the held rows: one segment (ZeRO >= 1) or the whole bucket (ZeRO-0)."""
    master: Optional[torch.Tensor] = None
    exp_avg: Optional[torch.Tensor] = None
    exp_avg_sq: Optional[torch.Tensor] = None
    home: Optional[object] = None   # NVMe offload (offload/nvme.py NvmeAdam): the three live in files instead


@dataclass
class Bucket:
    """Parameters reduced together: the layout (slots, segments, group), and the state kept per bucket.
    `shard` is this rank's segment index (0 without ZeRO)."""
    slots: list[Slot]
    group: Group
    nshard: int
    shard: int
    seg: int                        # S, elements per segment
    seq: int = 0                    # launch sequence (module chunk x dense/expert)
    chunk: int = 0                  # index of the model chunk (module) holding these parameters
    expert: bool = False
    unit: Optional[object] = None   # ZeRO-3 unit owning these parameters
    replica: Optional[Group] = None # HSDP: the reduced segment is then all-reduced over this group
    grad: GradSync = field(default_factory=GradSync)
    adam: AdamState = field(default_factory=AdamState)
    param_flat: Optional[torch.Tensor] = None   # ZeRO-0: flat params (views) / ZeRO-3: persistent shard

    @property
    def numel(self) -> int:
        return self.nshard * self.seg


def layout(slots: list[Slot]) -> int:
    """Assign chunk offsets; returns the segment size S."""
    off = 0
    for s in slots:
        s.offset = off
        off += s.chunk_numel
    return off


def split_buckets(named: list[tuple[str, nn.Parameter, bool]], group: Group, nshard: int, shard: int,
                  max_bytes: float, elem_bytes: int) -> list[Bucket]:
    """Consecutive runs of whole parameters, each closed once it reaches `max_bytes` of gradient."""
    buckets, cur, size = [], [], 0
    for name, p, decay in named:
        cur.append(make_slot(name, p, nshard, decay))
        size += p.numel() * elem_bytes
        if size >= max_bytes:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    return [Bucket(s, group, nshard, shard, layout(s)) for s in buckets]
