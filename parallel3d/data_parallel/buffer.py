"""Flat gradient buckets: two layouts of the same interface (which elements segment k holds, where a
parameter's gradient lives, the range this rank holds).

A bucket holds whole parameters that share one reduction group (dense: DP x CP; expert: expert-DP) and is
split into N equal segments (N = the ZeRO shard group's size, 1 without ZeRO); rank r holds segment r after
the reduce-scatter, and its optimizer state covers exactly that segment.

Contiguous ranges (ZeRO-1/2, HSDP's shard groups included; Megatron's distributed optimizer):

    bucket, N * S elements, parameters one after another, zero padding only at the end
    ┌──── segment 0 (rank 0) ────┬──── segment 1 (rank 1) ────┬──── segment 2 (rank 2) ───┐
    │ A            │ B           │             │ C            │        │░░░░░░░░░░░░░░░░░│
    └──────────────┴─────────────┴─────────────┴──────────────┴────────┴─────────────────┘
     offset oA = 0   oB = nA       (B straddles segments 0 and 1)        ░ pad to a multiple of N * ALIGN

The padding is at most N * ALIGN - 1 elements per bucket, so optimizer state is 1/N of the parameters up to
that; a parameter's gradient is one flat add and its gathered value one flat copy. A rank's piece of a
parameter is a flat element range (Slot.h_*), possibly empty, possibly cutting rows: clipping counts it
once, AdamW decays it, and checkpoints write it as a few rectangular boxes (state.py).

Rank-major rows (ZeRO-3 units, and ZeRO-0 where N = 1 and it is simply param-contiguous): each parameter is
cut along dim 0 into N chunks of c = ceil(rows / N) rows, and chunk k of every parameter lives in segment k
at the same offset. ZeRO-3 keeps it because its gathers work per unit and its fp8 gather (fp8_gather.py)
scales whole rows held by one rank; the price is padding of up to N - 1 rows per parameter.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from parallel3d.comm import Group
from parallel3d.params import ParamMeta


# Each segment (and so each rank's range, and the bucket) starts at a multiple of ALIGN elements: 256 bytes
# in fp32 (gradients, master, Adam state), 128 in bf16/fp16 (the parameter all-gather). NCCL's kernels and
# our Triton/fused kernels read 16-byte vectors and 128-byte lines best from aligned starts; the cost is
# under N * ALIGN padding per bucket (0.13M elements at dp=2048, against buckets of 40M+ elements).
ALIGN = 64


@dataclass
class Slot:
    """One parameter inside a bucket, and the part of it this rank holds (h_*: elements of the held
    segment [h_seg, h_seg + h_len) are elements [h_param, h_param + h_len) of the flattened parameter;
    the first h_real of them are real, not vocabulary padding)."""
    name: str
    param: nn.Parameter
    shape: tuple[int, ...]   # local (TP-local, padded) shape; a 0-d parameter is treated as (1,)
    rows: int                # shape[0]
    row_numel: int           # elements per row
    chunk_rows: int          # rows layout: c = ceil(rows / N)
    offset: int = 0          # rows: start of the chunk inside every segment; contiguous: start in the bucket
    decay: bool = True
    real_rows: int = 0       # rows without vocabulary padding (meta.local_real_shape[0])
    scalar: bool = False     # the parameter is 0-d
    local_copy: bool = False  # a tied copy whose source is on this rank too (V pipeline placement)
    contiguous: bool = False  # the bucket's layout (module docstring)
    muon: bool = False       # train.optimizer=muon orthogonalises it (muon_step.py; exp_avg is its momentum)
    h_seg: int = 0
    h_param: int = 0
    h_len: int = 0
    h_real: int = 0

    @property
    def meta(self) -> ParamMeta:
        return self.param.meta

    @property
    def numel(self) -> int:
        return self.rows * self.row_numel

    @property
    def chunk_numel(self) -> int:
        return self.chunk_rows * self.row_numel

    def valid_rows(self, k: int) -> int:
        """Rows layout: rows of the parameter held in segment k (the last chunks may be short or empty)."""
        return max(0, min(self.chunk_rows, self.rows - k * self.chunk_rows))

    def real_rows_in(self, k: int) -> int:
        """Rows layout: rows of segment k that are real (not vocabulary padding)."""
        return max(0, min(self.valid_rows(k), self.real_rows - k * self.chunk_rows))

    def flat(self, segment: torch.Tensor) -> torch.Tensor:
        """This parameter's part of a flat segment tensor (S,): rows layout, its chunk (in any segment);
        contiguous, the held range (of the held segment, or of the whole bucket when N = 1)."""
        if self.contiguous:
            return segment[self.h_seg: self.h_seg + self.h_len]
        return segment[self.offset: self.offset + self.chunk_numel]

    def held(self, segment: torch.Tensor, real: bool = True) -> torch.Tensor:
        """The held elements (real ones only, by default) in the held segment (S,), 1-D."""
        return segment[self.h_seg: self.h_seg + (self.h_real if real else self.h_len)]

    def whole(self, full: torch.Tensor) -> Optional[torch.Tensor]:
        """The whole parameter in a full bucket tensor (N*S,) as a flat view; None where it is not one piece
        (rows layout with N > 1)."""
        if self.contiguous or self.chunk_rows == self.rows:
            return full[self.offset: self.offset + self.numel]
        return None

    def rows_view(self, segment: torch.Tensor) -> torch.Tensor:
        """Rows layout: the chunk as (chunk_rows, *row shape)."""
        return self.flat(segment).view((self.chunk_rows,) + self.shape[1:])


def make_slot(name: str, p: nn.Parameter, nshard: int, decay: bool, contiguous: bool = False) -> Slot:
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
                scalar=p.dim() == 0, contiguous=contiguous)


def add_rows(full: torch.Tensor, seg: int, nshard: int, slot: Slot, src: torch.Tensor) -> None:
    """full (N*S,) bucket layout  +=  src (rows, ...), the parameter's gradient."""
    whole = slot.whole(full)
    if whole is not None:
        whole.add_(src.reshape(-1))
    else:
        _rows_op(full, seg, nshard, slot, src.reshape(-1), "add")


def copy_rows_out(full: torch.Tensor, seg: int, nshard: int, slot: Slot, dst: torch.Tensor) -> None:
    """dst (rows, ...)  <-  the parameter `slot` in full (N*S,), bucket layout. dst must be contiguous."""
    whole = slot.whole(full)
    if whole is not None:
        dst.view(-1).copy_(whole)
    else:
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
    """fp32 optimizer state of the held rows: one segment (ZeRO >= 1) or the whole bucket (ZeRO-0).
    Under Muon (muon_step.py) exp_avg is also the matrices' momentum, and exp_avg_sq is compact: it
    holds only the AdamW slots' ranges, `v_ranges` [(segment start, stop, start in exp_avg_sq)]."""
    master: Optional[torch.Tensor] = None
    exp_avg: Optional[torch.Tensor] = None
    exp_avg_sq: Optional[torch.Tensor] = None
    home: Optional[object] = None   # NVMe offload (offload/nvme.py NvmeAdam): the three live in files instead
    v_ranges: Optional[list[tuple[int, int, int]]] = None

    def second_moment(self, a: int, e: int) -> torch.Tensor:
        """exp_avg_sq of segment elements [a, e) (inside one AdamW range when compact)."""
        if self.v_ranges is None:
            return self.exp_avg_sq[a:e]
        for lo, hi, at in self.v_ranges:
            if lo <= a and e <= hi:
                return self.exp_avg_sq[at + a - lo: at + e - lo]
        raise KeyError(f"segment elements [{a}, {e}) have no second moment (a Muon matrix's)")


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
    param_flat: Optional[torch.Tensor] = None   # ZeRO-0/1/2: flat params (views) / ZeRO-3: persistent shard

    @property
    def numel(self) -> int:
        return self.nshard * self.seg


def layout(slots: list[Slot], nshard: int = 1, shard: int = 0) -> int:
    """Rows layout: assign chunk offsets and the held ranges of segment `shard`; returns the segment size S."""
    off = 0
    for s in slots:
        s.offset = off
        off += s.chunk_numel
        s.h_seg, s.h_param = s.offset, shard * s.chunk_numel
        s.h_len, s.h_real = s.valid_rows(shard) * s.row_numel, s.real_rows_in(shard) * s.row_numel
    return off


def padded_numel(total: int, nshard: int) -> int:
    """Elements of a contiguous bucket holding `total`: the next multiple of nshard * ALIGN (no padding
    without shards: the bucket is one allocation, aligned by the allocator, and there are no ranges)."""
    if nshard == 1:
        return total
    quantum = nshard * ALIGN
    return -(-total // quantum) * quantum


def contiguous_layout(slots: list[Slot], nshard: int, shard: int) -> int:
    """Parameters one after another, padded at the end (padded_numel); held ranges of segment `shard`.
    Returns the segment size S."""
    off = 0
    for s in slots:
        s.offset = off
        off += s.numel
    seg = padded_numel(off, nshard) // nshard
    lo_seg, hi_seg = shard * seg, (shard + 1) * seg
    for s in slots:
        lo, hi = max(s.offset, lo_seg), min(s.offset + s.numel, hi_seg)
        real_hi = min(hi, s.offset + s.real_rows * s.row_numel)
        if lo < hi:
            s.h_seg, s.h_param, s.h_len, s.h_real = lo - lo_seg, lo - s.offset, hi - lo, max(0, real_hi - lo)
        else:
            s.h_seg = s.h_param = s.h_len = s.h_real = 0
    return seg


def own_bucket(p: nn.Parameter) -> bool:
    """A parameter whose gradient is also summed over a group of ranks holding it in *other* buckets
    (the tied embedding on the first and the last pipeline stage): alone in its bucket, its held range
    depends only on its size and DP, so it is the same range on both stages (Megatron does the same)."""
    return "embedding" in p.meta.grad_reduce


def split_buckets(named: list[tuple[str, nn.Parameter, bool]], group: Group, nshard: int, shard: int,
                  max_elems: float) -> list[Bucket]:
    """Contiguous buckets: consecutive runs of whole parameters, each closed once it holds `max_elems`
    elements (own_bucket parameters alone)."""
    groups, cur, size = [], [], 0
    for name, p, decay in named:
        if own_bucket(p):
            if cur:
                groups.append(cur)
            groups.append([make_slot(name, p, nshard, decay, contiguous=True)])
            cur, size = [], 0
            continue
        cur.append(make_slot(name, p, nshard, decay, contiguous=True))
        size += p.numel()
        if size >= max_elems:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    return [Bucket(s, group, nshard, shard, contiguous_layout(s, nshard, shard)) for s in groups]
