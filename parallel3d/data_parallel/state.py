"""Optimizer state for checkpoints, reduced gradients for tests, and measured memory.

state_tensors representation (exact and rectangular):
    "master/<name>", "exp_avg/<name>", "exp_avg_sq/<name>" -> (fp32 data, global shape, global slices)
Under ZeRO >= 1 a rank holds rows [r*c, (r+1)*c) (c = ceil(rows/N)) of the TP-local tensor of every
parameter (buffer.py): a dim-0 block, so its global slices are meta.slices with dim 0 narrowed, minus
vocabulary padding rows. Without ZeRO a rank holds the whole TP-local tensor. Every element of every
global tensor is returned by exactly one rank in the world (the rule of clip.counts_once: ZeRO-0 only on
DP x CP / expert-DP rank 0, replicas in meta.replicated only on their group's rank 0), so the shards of
all ranks tile each tensor exactly, and a checkpoint written under one layout (any tp/pp/dp/zero) can be
read back under another through `read(name, slices)`. Entries are live views (under NVMe offload: copies
read from the files); copy before mutating.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from parallel3d.data_parallel.buffer import Bucket, Slot
from parallel3d.data_parallel.clip import counts_once, held
from parallel3d.mesh import ParallelContext

KINDS = ("master", "exp_avg", "exp_avg_sq")


def _rows(s: Slot, flat: torch.Tensor, n: int) -> torch.Tensor:
    t = s.rows_view(flat)[:n]
    return t.reshape(()) if s.scalar else t


def _state_rows(b: Bucket, s: Slot, kind: str, n: int) -> torch.Tensor:
    """The held rows of one kind of Adam state (read from the files when they live on NVMe)."""
    if b.adam.home is None:
        return _rows(s, getattr(b.adam, kind), n)
    t = b.adam.home.read_rows(kind, b, s.offset, n * s.row_numel).view((n,) + s.shape[1:])
    return t.reshape(()) if s.scalar else t


def state_tensors(buckets: Sequence[Bucket], ctx: ParallelContext, zero: int) -> dict:
    out = {}
    for b in buckets:
        for s in b.slots:
            k, n = held(b, s)
            if n == 0 or not counts_once(b, s, ctx, zero):
                continue
            slices = s.global_slices(k, n)
            for kind in KINDS:
                out[f"{kind}/{s.name}"] = (_state_rows(b, s, kind, n), s.meta.global_shape, slices)
    return out


@torch.no_grad()
def load_state_tensors(buckets: Sequence[Bucket], read: Callable, kinds: tuple[str, ...] = KINDS) -> None:
    """Fill every held row (replicas included) from read(name, global slices). The caller then refreshes
    the model parameters from the master weights."""
    for b in buckets:
        for s in b.slots:
            k, n = held(b, s)
            if n == 0:
                continue
            slices = s.global_slices(k, n)
            for kind in kinds:
                data = read(f"{kind}/{s.name}", slices)
                if b.adam.home is not None:
                    b.adam.home.write_rows(kind, b, s.offset, data)
                else:
                    s.rows_view(getattr(b.adam, kind))[:n].copy_(data.reshape((n,) + s.shape[1:]))


def grad_slices(buckets: Sequence[Bucket], inv_scale: float) -> dict:
    """name -> (reduced gradient rows this rank holds times inv_scale, global slices, global shape).

    Call after the gradient sync (before clipping/step); the format of tests/parity.local_slices."""
    inv = inv_scale
    out = {}
    for b in buckets:
        for s in b.slots:
            k, n = held(b, s)
            if n:
                out[s.name] = (_rows(s, b.grad.shard, n).float() * inv, s.global_slices(k, n), s.meta.global_shape)
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


class OptimizerState:
    """The DistributedOptimizer's checkpoint and accounting API (a mixin over its buckets, params, scaler,
    compressor and published parameters): what checkpoint.protocol's optimizer side and the planner read."""

    def scalar_state(self) -> dict:
        out = {"step": self.step_count}
        if self.scaler is not None:
            out.update(self.scaler.state())
        return out

    def load_scalar_state(self, d: dict) -> None:
        self.step_count = int(d.get("step", 0))
        if self.scaler is not None:
            self.scaler.load(d)

    def state_tensors(self) -> dict[str, tuple[torch.Tensor, tuple, tuple[slice, ...]]]:
        if self.published is not None:   # a checkpoint also reads the parameters
            self.published.wait_all()
        self.wait_params()
        return state_tensors(self.buckets, self.ctx, self.zero)

    def load_state_tensors(self, read: Callable[[str, tuple[slice, ...]], torch.Tensor],
                           kinds: tuple[str, ...] = KINDS) -> None:
        load_state_tensors(self.buckets, read, kinds)
        if "master" in kinds:
            self.publish_params()

    def local_state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's own state (not a slice of a global tensor): gradient-compression residuals and
        PowerSGD's Q. Checkpoints keep it per rank and restore it under the same layout."""
        return self.compressor.local_state() if self.compressor is not None else {}

    def load_local_state_tensors(self, state: dict[str, torch.Tensor]) -> None:
        if self.compressor is not None:
            self.compressor.load_local_state(state)

    def grad_slices(self) -> dict[str, tuple[torch.Tensor, tuple[slice, ...], tuple]]:
        self.finish_grad_sync()
        inv = 1.0 if self._prepared or self.scaler is None else 1.0 / self.scaler.scale
        return grad_slices(self.buckets, inv)

    def memory_bytes(self) -> dict[str, int]:
        return memory_bytes(self.buckets, self.params)

    def state_by_category(self) -> dict[str, list[torch.Tensor]]:
        """Model-state tensors per category (params, grads, optimizer); see state.state_by_category."""
        return state_by_category(self.buckets, self.params)
