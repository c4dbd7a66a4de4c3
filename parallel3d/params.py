"""Parameter metadata: how a local tensor relates to the global parameter, and layout-free initialisation.

Every parameter created by a parallel3d layer carries `param.meta: ParamMeta`:
  global_shape   shape of the whole (unpadded) parameter, identical under every layout
  slices         the global index range (one slice per dim) held by this rank; the local tensor may have
                 extra trailing padding rows (vocab padding), which never reach checkpoints or the loss
  grad_reduce    names of context groups whose ranks hold *partial* gradients of this same slice that
                 must be summed (e.g. "tp" for sequence-parallel norm weights and replicated kv heads)
  replicated     names of context groups over which the slice is replicated (count it once in norms)
  init           "normal" | "ones" | "zeros"; `init_name` overrides the name used for seeding (tied copies)

Initialisation is a function of (seed, name, global shape): the full tensor is drawn from a generator
seeded by a stable hash of (seed, name) and this rank keeps its slice, so every layout starts from the
same weights.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch


@dataclass
class ParamMeta:
    global_shape: tuple[int, ...]
    slices: tuple[slice, ...]
    init: str = "normal"
    std: Optional[float] = None
    grad_reduce: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    init_name: Optional[str] = None
    expert: bool = False          # expert weights reduce over expert-DP instead of DP x CP
    extra: dict = field(default_factory=dict)

    @property
    def local_real_shape(self) -> tuple[int, ...]:
        return tuple(s.stop - s.start for s in self.slices)


def full_slices(shape: Iterable[int]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def shard_slices(shape: tuple[int, ...], dim: int, index: int, count: int) -> tuple[slice, ...]:
    """Slices of the index-th of `count` equal shards along dim (dim size divisible by count)."""
    if shape[dim] % count:
        raise ValueError(f"dimension {dim} of size {shape[dim]} is not divisible into {count} shards")
    size = shape[dim] // count
    out = list(full_slices(shape))
    out[dim] = slice(index * size, (index + 1) * size)
    return tuple(out)


def new_param(local_shape: tuple[int, ...], meta: ParamMeta, dtype: torch.dtype = torch.float32,
              device: Optional[torch.device] = None) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.empty(local_shape, dtype=dtype, device=device))
    p.meta = meta
    return p


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def global_init_tensor(seed: int, name: str, meta: ParamMeta, default_std: float) -> torch.Tensor:
    """The whole parameter as every layout sees it (fp32, CPU)."""
    shape = meta.global_shape
    if meta.init == "ones":
        return torch.ones(shape)
    if meta.init == "zeros":
        return torch.zeros(shape)
    gen = torch.Generator().manual_seed(_seed_for(seed, meta.init_name or name))
    std = default_std if meta.std is None else meta.std
    return torch.randn(shape, generator=gen) * std


@torch.no_grad()
def init_parameters(module: torch.nn.Module, seed: int, default_std: float = 0.02,
                    prefix: str = "") -> None:
    """Fill every parameter with its slice of the layout-independent global tensor."""
    for name, p in module.named_parameters(prefix=prefix.rstrip(".")):
        meta = getattr(p, "meta", None)
        if meta is None:
            meta = p.meta = ParamMeta(tuple(p.shape), full_slices(p.shape))
        full = global_init_tensor(seed, name, meta, default_std)
        load_global_slice(p, full[meta.slices])


@torch.no_grad()
def load_global_slice(p: torch.Tensor, value: torch.Tensor) -> None:
    """Copy `value` (this rank's real slice) into p, zeroing any padding rows after it."""
    real = tuple(slice(0, n) for n in value.shape)
    p.zero_()
    p[real].copy_(value.to(p.dtype))


def real_part(t: torch.Tensor, meta: ParamMeta) -> torch.Tensor:
    """The local tensor (or its gradient) without padding rows."""
    return t[tuple(slice(0, n) for n in meta.local_real_shape)]
