"""Gradient compression with error feedback for ZeRO-0/1: PowerSGD (low rank) and top-k (sparse).

Each rank keeps a residual e_i (what it has not sent yet) per bucket, in the bucket's own flat layout
(buffer.py: the contiguous one, so a parameter's residual is one flat range of it). At a compressed step, with g_i this rank's accumulated gradient and N the group size:

    E_i = g_i + e_i                                  error feedback: add what earlier steps held back
    S   ~ sum_i E_i                                  sent compressed (below); every rank gets the same S
    e_i <- E_i - (its share of S)                    so sum_i (sent + e_i) = sum_i E_i, nothing is lost

PowerSGD (Vogels et al. 2019), per parameter viewed as a matrix M_i (m = rows, n = elements per row) with
rank r and a warm-started Q (n, r) that is identical on every rank:

    P = sum_i M_i Q          (m, r)   all-reduce of m*r elements
    P <- orthonormal columns of P      (Gram-Schmidt; every rank has the same P, so the same result)
    Q = sum_i M_i^T P        (n, r)   all-reduce of n*r elements
    S = P Q^T                (m, n)   e_i <- M_i - S / N

so a matrix costs r*(m+n) elements instead of m*n. Parameters of one dimension, and matrices where
r*(m+n) >= m*n, are all-reduced uncompressed (their residual stays 0).

Top-k, per bucket: each rank sends the k = ceil(ratio * numel) entries of E_i largest in magnitude, as k
values and k int32 indices (all-gathered); S is their scatter-add, and e_i is E_i with the sent entries zeroed.

Compressed payloads go over a Group named "<group>_compressed" (the same process group), so `comm_bytes`
shows them apart from the uncompressed reductions. Steps before `start_step` reduce exactly (warm-up).
"""
from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.data_parallel.buffer import Bucket, Slot, add_rows, copy_rows_out

MODES = ("none", "powersgd", "topk")


def check_compression(mode: str, zero: int, rank: int, ratio: float, start: int, hsdp: bool,
                      precision: str, group_size: int = 1) -> None:
    """parallel.grad_compression and its keys; compression replaces the ZeRO-0/1 gradient reduction.
    group_size: the ranks a dense bucket is reduced over (DP x CP), for top-k's break-even (topk_wire_ratio)."""
    if mode not in MODES:
        raise ValueError(f"parallel.grad_compression={mode!r} is not one of {', '.join(MODES)}")
    if mode == "none":
        return
    if zero not in (0, 1):
        raise ValueError(f"parallel.grad_compression={mode} works with parallel.zero=0 or 1 (it all-reduces "
                         f"the whole gradient), got zero={zero}")
    if hsdp:
        raise ValueError(f"parallel.grad_compression={mode} does not combine with HSDP (parallel.dp_shard < dp)")
    if precision == "fp16":
        raise ValueError(f"parallel.grad_compression={mode} needs train.precision fp32 or bf16: the fp16 loss "
                         f"scale changes, and the residuals would be kept in stale units")
    if mode == "powersgd" and (not isinstance(rank, int) or rank < 1):
        raise ValueError(f"parallel.powersgd_rank must be a positive integer, got {rank!r}")
    if mode == "topk" and not 0.0 < ratio <= 1.0:
        raise ValueError(f"parallel.topk_ratio must be in (0, 1], got {ratio!r}")
    if start < 0:
        raise ValueError(f"parallel.compression_start_step must be >= 0, got {start}")
    if mode == "topk" and topk_wire_ratio(ratio, group_size) >= 1.0:
        n = group_size
        raise ValueError(
            f"parallel.topk_ratio={ratio} over {n} ranks (DP x CP) sends more than the dense all-reduce it replaces: "
            f"each rank receives the k = ratio x n entries of every rank, values and int32 indices, "
            f"{n} x {ratio} x n x 8 = {8 * n * ratio:.3g} x n bytes per bucket of n fp32 gradients, against "
            f"2 x ({n}-1)/{n} x n x 4 = {8 * (n - 1) / n:.3g} x n bytes for a ring all-reduce. Use "
            f"parallel.topk_ratio < {(n - 1) / n ** 2:.3g} (that is (N-1)/N^2), or parallel.grad_compression=none")


def topk_wire_ratio(ratio: float, n: int) -> float:
    """Bytes top-k moves per rank over those of the dense ring all-reduce it replaces, for a bucket of
    numel fp32 gradients reduced over n ranks: all-gathering k = ratio*numel values and int32 indices from
    every rank receives n*k*(4+4) bytes; the ring all-reduce sends 2*(n-1)/n*numel*4. So top-k loses past
    ratio = (n-1)/n^2, about 1/n. With one rank nothing travels either way (0)."""
    if n <= 1:
        return 0.0
    return (n * ratio * 8) / (2 * (n - 1) / n * 4)


def _read(full: torch.Tensor, b: Bucket, s: Slot) -> torch.Tensor:
    """Slot s of a bucket-layout tensor as an (m, n) matrix: a view where the layout keeps the parameter in
    one piece (contiguous buckets, or no shards), else a copy."""
    whole = s.whole(full)
    if whole is not None:
        return whole.view(s.rows, s.row_numel)   # (m, n)
    out = torch.empty((s.rows, s.row_numel), dtype=full.dtype, device=full.device)
    copy_rows_out(full, b.seg, b.nshard, s, out)
    return out


def _write(full: torch.Tensor, b: Bucket, s: Slot, value: Optional[torch.Tensor]) -> None:
    """Slot s of a bucket-layout tensor <- value (m, n), or zeros for None."""
    whole = s.whole(full)
    if whole is not None:
        dst = whole.view(s.rows, s.row_numel)
        dst.zero_() if value is None else dst.copy_(value)
        return
    for k in range(b.nshard):   # zero the slot's rows in every segment, then add the new ones
        n = s.valid_rows(k)
        if n:
            seg = full[k * b.seg: (k + 1) * b.seg]
            s.flat(seg)[: n * s.row_numel].zero_()
    if value is not None:
        add_rows(full, b.seg, b.nshard, s, value)


def orthonormalize_(p: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Gram-Schmidt on the columns of p (m, r), in place."""
    for j in range(p.shape[1]):
        col = p[:, j]
        if j:
            prev = p[:, :j]                                   # (m, j)
            col -= prev @ (prev.t() @ col)
        col /= col.norm() + eps
    return p


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"powersgd:{name}".encode()).digest()[:8], "little") & (2 ** 63 - 1)


class Compressor:
    """Compressed gradient reduction of ZeRO-0/1 buckets, with per-rank residuals (error feedback)."""

    def __init__(self, mode: str, buckets: list[Bucket], rank: int = 4, ratio: float = 0.01,
                 start_step: int = 0) -> None:
        self.mode, self.rank, self.ratio, self.start_step = mode, rank, ratio, start_step
        self.residual = {id(b): None for b in buckets}      # lazily allocated like the gradient buffers
        self.q: dict[str, torch.Tensor] = {}                 # PowerSGD: warm-started Q per matrix
        self.compressed = {id(b): Group(f"{b.group.name}_compressed", b.group.ranks, b.group.global_rank,
                                        b.group.pg, b.group.stats, b.group.device) for b in buckets}
        self.buckets = buckets

    def active(self, step: int) -> bool:
        return self.mode != "none" and step >= self.start_step

    def lowrank(self, s: Slot) -> bool:
        """PowerSGD compresses this parameter (a matrix that the rank-r form makes smaller)."""
        return s.param.dim() >= 2 and self.rank * (s.rows + s.row_numel) < s.rows * s.row_numel

    def _residual(self, b: Bucket) -> torch.Tensor:
        if self.residual[id(b)] is None:
            self.residual[id(b)] = torch.zeros_like(b.grad.full)
        return self.residual[id(b)]

    def _q(self, s: Slot, device: torch.device) -> torch.Tensor:
        if s.name not in self.q:
            gen = torch.Generator().manual_seed(_seed(s.name))   # the same Q on every rank of the group
            self.q[s.name] = torch.randn((s.row_numel, self.rank), generator=gen).to(device)  # (n, r)
        return self.q[s.name]

    @torch.no_grad()
    def reduce(self, b: Bucket) -> None:
        """b.grad.full (this rank's gradient) <- the compressed sum over the group; residual updated."""
        res = self._residual(b)
        res.add_(b.grad.full)                                 # res = E_i
        if self.mode == "powersgd":
            self._powersgd(b, res)
        else:
            self._topk(b, res)

    def _powersgd(self, b: Bucket, res: torch.Tensor) -> None:
        group, wire = b.group, self.compressed[id(b)]
        low = [s for s in b.slots if self.lowrank(s)]
        plain = [s for s in b.slots if not self.lowrank(s)]
        if plain:                                             # exact all-reduce, no residual
            flat = torch.cat([_read(res, b, s).reshape(-1) for s in plain])
            comm.all_reduce(flat, group)
            for s, part in zip(plain, flat.split([s.rows * s.row_numel for s in plain])):
                _write(b.grad.full, b, s, part.view(s.rows, s.row_numel))
                _write(res, b, s, None)
        if not low:
            return
        mats = [_read(res, b, s) for s in low]                # M_i (m, n) each
        qs = [self._q(s, res.device) for s in low]
        p_flat = torch.cat([(m @ q).reshape(-1) for m, q in zip(mats, qs)])   # sum_j m*r
        comm.all_reduce(p_flat, wire)
        ps = [orthonormalize_(p.view(s.rows, self.rank)) for s, p in
              zip(low, p_flat.split([s.rows * self.rank for s in low]))]        # (m, r) each
        q_flat = torch.cat([(m.t() @ p).reshape(-1) for m, p in zip(mats, ps)])  # sum_j n*r
        comm.all_reduce(q_flat, wire)
        inv = 1.0 / group.size
        for s, m, p, q in zip(low, mats, ps, q_flat.split([s.row_numel * self.rank for s in low])):
            q = q.view(s.row_numel, self.rank)
            self.q[s.name].copy_(q)                           # warm start of the next step
            approx = p @ q.t()                                # (m, n): S
            _write(b.grad.full, b, s, approx)
            _write(res, b, s, m - approx * inv)               # e_i = M_i - S / N

    def _topk(self, b: Bucket, res: torch.Tensor) -> None:
        wire = self.compressed[id(b)]
        k = max(1, math.ceil(self.ratio * res.numel()))
        idx = res.abs().topk(k, sorted=False).indices         # (k,)
        values = res[idx]                                     # (k,)
        res[idx] = 0                                          # e_i: what was not sent
        all_values = comm.all_gather(values, wire)            # (N*k,)
        all_idx = comm.all_gather(idx.to(torch.int32), wire)  # (N*k,)
        b.grad.full.zero_().index_add_(0, all_idx.long(), all_values)

    # ---- checkpoint: per-rank state --------------------------------------------------------------------
    def local_state(self) -> dict[str, torch.Tensor]:
        """residual/<param> (m, n) of every allocated residual, powersgd_q/<param> (n, r): this rank's own."""
        out = {}
        for b in self.buckets:
            res = self.residual[id(b)]
            if res is not None:
                for s in b.slots:
                    out[f"residual/{s.name}"] = _read(res, b, s).clone()
        for name, q in self.q.items():
            out[f"powersgd_q/{name}"] = q
        return out

    @torch.no_grad()
    def load_local_state(self, state: dict[str, torch.Tensor]) -> None:
        for b in self.buckets:
            names = [f"residual/{s.name}" for s in b.slots]
            if any(n in state for n in names):
                res = torch.zeros(b.numel, dtype=b.grad.full.dtype, device=b.grad.full.device)
                for s, n in zip(b.slots, names):
                    if n in state:
                        _write(res, b, s, state[n].to(res.device, res.dtype).view(s.rows, s.row_numel))
                self.residual[id(b)] = res
        for key, t in state.items():
            if key.startswith("powersgd_q/"):
                self.q[key[len("powersgd_q/"):]] = t.to(self.buckets[0].grad.full.device).clone()
