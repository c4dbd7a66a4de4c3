"""Muon on sharded matrices: each whole matrix orthogonalised on one rank, the update back in every range.

After the gradient sync each rank of a ZeRO shard group (N ranks) holds a flat range of every bucket
(contiguous ranges under ZeRO-1/2 that cut matrices anywhere, row chunks under ZeRO-3; the whole bucket
under ZeRO-0). Its Muon momentum (kept in the bucket's `exp_avg`, the same flat layout) covers that range.
The step, per shard group:

    1. momentum and Nesterov input on the held range (elementwise, so exact on any range)
    2. all-to-all: every piece of matrix M goes to M's owner, a rank of the group chosen by
       muon.assign_owners (FLOPs-balanced, the same on every rank)
           rank 0 range ──┐                                owner of M: U_M = [piece_0; piece_1; ...]
           rank 1 range ──┼── pieces of M ──────────────▶  (the ranges are in rank order, so the pieces
           rank 2 range ──┘                                 concatenate to M's flat elements)
    3. the owner orthogonalises: gather mode joins the TP shards first (an all-gather over TP along the
       split dim; every TP peer owns the same matrix and takes its own slice of NS(U)), blockwise
       orthogonalises the TP shard alone (an approximation of Muon on the whole matrix)
    4. all-to-all back: each range receives its piece of O_M and applies decay and -adjust(lr) * O_M to
       its fp32 master, which the parameter publisher then spreads as after AdamW

Exact: every matrix sees the world-size-1 input U and its update lands on the elements that held U.
ZeRO-0 needs no exchange (every rank holds the whole bucket and orthogonalises every matrix); expert
matrices exchange over the expert shard group (whole experts on their EP rank); HSDP's replicas repeat
their shard group's step. Two all-to-alls per shard group and step (in flight: the momentum's bytes).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from parallel3d import comm
from parallel3d.data_parallel.buffer import Bucket, Slot
from parallel3d.data_parallel.muon import (NS_PRECISIONS, LogicalMatrix, adjust_lr, assign_owners, logical_matrices,
                                           newton_schulz, ns_flops)
from parallel3d.mesh import ParallelContext


def muon_slot(s: Slot) -> bool:
    """The parameter takes Muon (ParamMeta.matrix, muon.py's rule)."""
    return s.meta.matrix


def held_range(b: Bucket, s: Slot, k: int) -> tuple[int, int]:
    """[start, stop) of the flattened parameter that rank k of the shard group holds (buffer.py layouts)."""
    if b.nshard == 1:
        return 0, s.numel
    if s.contiguous:
        lo, hi = max(s.offset, k * b.seg), min(s.offset + s.numel, (k + 1) * b.seg)
        return (lo - s.offset, hi - s.offset) if lo < hi else (0, 0)
    lo, hi = k * s.chunk_numel, min(s.rows, (k + 1) * s.chunk_rows) * s.row_numel
    return (lo, hi) if lo < hi else (0, 0)


def compact_second_moment(b: Bucket, ranges: list[tuple[int, int]]) -> None:
    """Muon's matrices keep no second moment: exp_avg_sq shrinks to the AdamW ranges (AdamState.v_ranges).
    At construction, while it is still all zeros."""
    v = b.adam.exp_avg_sq
    if v is None:
        return
    b.adam.v_ranges, at = [], 0
    for a, e in ranges:
        b.adam.v_ranges.append((a, e, at))
        at += e - a
    b.adam.exp_avg_sq = torch.zeros(at, dtype=v.dtype, device=v.device)


@dataclass
class Matrix:
    """A logical matrix of a bucket's slot, its owner and the flat pieces each rank holds of it."""
    bucket: Bucket
    slot: Slot
    m: LogicalMatrix
    owner: int = 0
    pieces: list[tuple[int, int, int]] = field(default_factory=list)   # (rank, param start, param stop)

    def piece(self, k: int) -> Optional[tuple[int, int]]:
        for r, a, e in self.pieces:
            if r == k:
                return a, e
        return None

    def piece_len(self, k: int) -> int:
        piece = self.piece(k)
        return 0 if piece is None else piece[1] - piece[0]


@dataclass
class ShardGroup:
    """The matrices whose pieces live on one shard group (N ranks; N = 1: all on this rank)."""
    group: Optional[comm.Group]
    nshard: int
    rank: int
    matrices: list[Matrix]


class MuonStep:
    """Muon for the buckets' matrix slots (module docstring); AdamW keeps the other slots (adamw_ranges)."""

    def __init__(self, buckets: Sequence[Bucket], ctx: ParallelContext, config) -> None:
        c = config
        self.ctx, self.momentum, self.nesterov, self.steps = ctx, c.muon_momentum, c.muon_nesterov, c.muon_ns_steps
        self.weight_decay, self.adjust, self.base_lr, self.muon_lr = c.muon_decay, c.muon_adjust_lr_fn, c.lr, c.muon_lr
        self.dtype, self.gather = NS_PRECISIONS[c.muon_ns_precision], c.muon_tp_mode == "gather"
        self.groups: list[ShardGroup] = []
        by_group: dict[int, ShardGroup] = {}
        for b in buckets:
            key = id(b.group) if b.nshard > 1 else -1 - len(by_group)   # N = 1: no exchange, its own entry
            g = by_group.get(key)
            if g is None:
                g = by_group[key] = ShardGroup(b.group if b.nshard > 1 else None, b.nshard, b.shard, [])
                self.groups.append(g)
            for s in b.slots:
                if muon_slot(s):
                    s.muon = True
                    for m in logical_matrices(s.name, s.meta, s.shape):
                        mat = Matrix(b, s, m)
                        for k in range(b.nshard):
                            a, e = held_range(b, s, k)
                            lo, hi = max(a, m.start), min(e, m.start + m.rows * m.cols)
                            if lo < hi:
                                mat.pieces.append((k, lo, hi))
                        g.matrices.append(mat)
        for b in buckets:
            compact_second_moment(b, self.adamw_ranges(b))
        for g in self.groups:
            costs = [ns_flops(*self.ns_shape(x.m), self.steps) for x in g.matrices]
            for x, o in zip(g.matrices, assign_owners(costs, g.nshard)):
                x.owner = o

    def ns_shape(self, m: LogicalMatrix) -> tuple[int, int]:
        """The shape the iteration (and adjust_lr) sees: the joined TP matrix in gather mode, else the shard."""
        return m.full if self.gather and m.split is not None else (m.rows, m.cols)

    @staticmethod
    def adamw_ranges(b: Bucket) -> list[tuple[int, int]]:
        """[start, stop) ranges of the held segment that AdamW updates (the slots Muon does not)."""
        return [(s.h_seg, s.h_seg + s.h_len) for s in b.slots if s.h_len and not s.muon]

    def lr_for(self, lr: float) -> float:
        """train.muon_lr follows the schedule of train.lr (0: train.lr itself)."""
        return lr if not self.muon_lr else self.muon_lr * lr / self.base_lr

    @torch.no_grad()
    def step(self, lr: float) -> None:
        lr = self.lr_for(lr)
        for g in self.groups:
            mine = [x for x in g.matrices if x.owner == g.rank]
            inputs = self._to_owners(g, mine, self._momentum(g))
            updates = [self._orthogonalise(x, u) for x, u in zip(mine, inputs)]
            self._apply(g, self._back_to_ranges(g, mine, updates), lr)

    def _to_owners(self, g: ShardGroup, mine: list[Matrix], held: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        """All-to-all 1: every rank's pieces of the Nesterov input to each matrix's owner; returns the
        owned matrices whole, (rows, cols) each, in plan order."""
        sends = [[t for t in (self._own(x, held.get(id(x.slot))) for x in g.matrices if x.owner == o)
                  if t is not None] for o in range(g.nshard)]
        received = self._exchange(g, sends, [sum(x.piece_len(k) for x in mine) for k in range(g.nshard)])
        cursor, out = [0] * g.nshard, []
        for x in mine:   # the pieces arrive by source rank, each source's in plan order
            parts = []
            for k, a, e in x.pieces:
                parts.append(received[k][cursor[k]: cursor[k] + e - a])
                cursor[k] += e - a
            out.append(torch.cat(parts).view(x.m.rows, x.m.cols))   # (rows, cols): ranks' pieces in order
        return out

    def _back_to_ranges(self, g: ShardGroup, mine: list[Matrix], updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """All-to-all 2: each owned update's pieces to the ranks holding them; returns what arrived from
        each owner (its matrices' pieces of this rank's ranges, in plan order)."""
        sends = [[] for _ in range(g.nshard)]
        for x, o in zip(mine, updates):   # o: (rows * cols,) fp32
            for k, a, e in x.pieces:
                sends[k].append(o[a - x.m.start: e - x.m.start])
        return self._exchange(g, sends, [sum(x.piece_len(g.rank) for x in g.matrices if x.owner == o)
                                         for o in range(g.nshard)])

    def _apply(self, g: ShardGroup, back: list[torch.Tensor], lr: float) -> None:
        """W <- W (1 - lr wd) - adjust(lr, shape) O on every held piece, as torch.optim.Muon (the decay
        with the unadjusted lr)."""
        cursor = [0] * g.nshard
        for x in g.matrices:
            piece = x.piece(g.rank)
            if piece is None:
                continue
            a, e = piece
            upd = back[x.owner][cursor[x.owner]: cursor[x.owner] + e - a]
            cursor[x.owner] += e - a
            s = x.slot
            p = x.bucket.adam.master[s.h_seg + a - s.h_param: s.h_seg + e - s.h_param]
            if s.decay and self.weight_decay:
                p.mul_(1 - lr * self.weight_decay)
            p.add_(upd.to(p.device), alpha=-adjust_lr(lr, self.adjust, self.ns_shape(x.m)))

    def _momentum(self, g: ShardGroup) -> dict[int, torch.Tensor]:
        """B <- lerp(B, G, 1 - mu) on every held range of the group's matrix slots; returns the Nesterov
        input per slot (flat, over the held range)."""
        out = {}
        for x in g.matrices:
            s, b = x.slot, x.bucket
            if id(s) in out or not s.h_len:
                continue
            grad = b.grad.shard[s.h_seg: s.h_seg + s.h_len].float()
            buf = b.adam.exp_avg[s.h_seg: s.h_seg + s.h_len]
            buf.lerp_(grad, 1 - self.momentum)
            out[id(s)] = grad.lerp(buf, self.momentum) if self.nesterov else buf
        return out

    @staticmethod
    def _own(x: Matrix, inp: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This rank's piece of x's Nesterov input (None: it holds none)."""
        piece = x.piece(x.bucket.shard)
        if inp is None or piece is None:
            return None
        return inp[piece[0] - x.slot.h_param: piece[1] - x.slot.h_param]

    def _exchange(self, g: ShardGroup, sends: list[list[torch.Tensor]], recv_sizes: list[int]) -> list[torch.Tensor]:
        """sends[k]: the flat tensors for rank k, in order; returns what each rank k sent here (on the
        compute device: offloaded state travels, and is orthogonalised, there)."""
        dev = self.ctx.device
        flat = [torch.cat([t.to(dev, torch.float32) for t in parts]) if parts
                else torch.zeros(0, device=dev) for parts in sends]
        if g.nshard == 1:
            return flat
        sizes = [t.numel() for t in flat]
        recv = comm.all_to_all(torch.cat(flat), g.group, out_splits=recv_sizes, in_splits=sizes)
        return list(torch.split(recv, recv_sizes))

    def _orthogonalise(self, x: Matrix, u: torch.Tensor) -> torch.Tensor:
        """NS of the owned matrix u (rows, cols), flat fp32; gather mode joins and re-splits TP shards."""
        split = x.m.split if self.gather else None
        if split is None:
            return newton_schulz(u, self.steps, self.dtype).float().reshape(-1)
        tp = self.ctx.etp if x.bucket.expert else self.ctx.tp   # experts are split over the expert TP group
        full = comm.all_gather(u.contiguous(), tp, dim=split)   # (rows*tp, cols) or (rows, cols*tp)
        size = u.shape[split]
        return newton_schulz(full, self.steps, self.dtype).narrow(split, tp.rank * size, size).float().reshape(-1)

