"""Parameter metadata: how a local tensor relates to the global parameter, and layout-free initialisation.

Every parameter created by a parallel3d layer carries `param.meta: ParamMeta`:
  global_shape   shape of the whole (unpadded) parameter, identical under every layout
  slices         the global index range (one slice per dim) held by this rank; the local tensor may have
                 extra trailing padding rows (vocab padding), which never reach checkpoints or the loss
  grad_reduce    names of context groups whose ranks hold *partial* gradients of this same slice that
                 must be summed (e.g. "tp" for sequence-parallel norm weights and replicated kv heads)
  replicated     names of context groups over which the slice is replicated (count it once in norms)
  init           "normal" | "ones" | "zeros"; `tied_to` names the parameter this one is a copy of (seeding, checkpoints)
  matrix         a hidden layer's projection weight (out, in), or stacked experts (E, out, in): what Muon
                 orthogonalises (data_parallel/muon.py); set by the layers that build projections, not by
                 the embedding, the vocabulary head, the router or norms
  parts          a fused matrix's logical parts, as global row counts along its out dimension (q/k/v,
                 gate/up); () is one matrix. Under TP each rank holds parts[i] / tp rows of each part

Initialisation is a function of (seed, name, global shape): values are drawn in row blocks, each from a
generator seeded by a stable hash of (seed, name, block), and a rank draws only the blocks its slice
overlaps, so every layout starts from the same weights without materialising whole tensors.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
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
    tied_to: Optional[str] = None  # a copy of this parameter (tied embeddings): seeded, saved and loaded as it
    expert: bool = False          # expert weights reduce over expert-DP instead of DP x CP
    matrix: bool = False          # a hidden projection Muon orthogonalises (see above)
    parts: tuple[int, ...] = ()   # a fused matrix's logical row counts (global), () for one matrix

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


def _seed_for(seed: int, name: str, block: int) -> int:
    digest = hashlib.sha256(f"{seed}:{name}:{block}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


_BLOCK_ELEMENTS = 1 << 22  # random values are drawn in row blocks of about 16 MB


def init_slice(seed: int, name: str, meta: ParamMeta, default_std: float,
               slices: Optional[tuple[slice, ...]] = None) -> torch.Tensor:
    """Part `slices` (default: this rank's meta.slices) of the layout-independent initial value (fp32, CPU).

    Values are drawn in blocks of rows whose size depends only on the global shape, each block from its own
    generator seeded by (seed, name, block index). A rank therefore draws only the row blocks it overlaps:
    the full tensor (e.g. a 128k-row embedding) is never materialised on a rank that holds a shard of it.
    """
    shape = meta.global_shape
    slices = meta.slices if slices is None else slices
    out_shape = tuple(s.stop - s.start for s in slices)
    if meta.init in ("ones", "zeros"):
        return (torch.ones if meta.init == "ones" else torch.zeros)(out_shape)
    std = default_std if meta.std is None else meta.std
    if len(shape) == 0:
        gen = torch.Generator().manual_seed(_seed_for(seed, meta.tied_to or name, 0))
        return torch.randn((), generator=gen) * std
    row_numel = max(1, int(torch.tensor(shape[1:]).prod().item()) if len(shape) > 1 else 1)
    rows_per_block = max(1, _BLOCK_ELEMENTS // row_numel)
    out = torch.empty(out_shape)
    r0, r1 = slices[0].start, slices[0].stop
    for block in range(r0 // rows_per_block, (r1 - 1) // rows_per_block + 1 if r1 > r0 else 0):
        b0 = block * rows_per_block
        b1 = min(b0 + rows_per_block, shape[0])
        gen = torch.Generator().manual_seed(_seed_for(seed, meta.tied_to or name, block))
        values = torch.randn((b1 - b0,) + tuple(shape[1:]), generator=gen) * std  # (rows in block, ...)
        lo, hi = max(b0, r0), min(b1, r1)
        out[lo - r0:hi - r0] = values[(slice(lo - b0, hi - b0),) + tuple(slices[1:])]
    return out


def global_init_tensor(seed: int, name: str, meta: ParamMeta, default_std: float) -> torch.Tensor:
    """The whole parameter as every layout sees it (fp32, CPU): for tests and tools, not for training."""
    return init_slice(seed, name, meta, default_std, full_slices(meta.global_shape))


@torch.no_grad()
def init_parameters(module: torch.nn.Module, seed: int, default_std: float = 0.02,
                    prefix: str = "") -> None:
    """Fill every parameter with its slice of the layout-independent global tensor."""
    for name, p in module.named_parameters(prefix=prefix.rstrip(".")):
        meta = getattr(p, "meta", None)
        if meta is None:
            meta = p.meta = ParamMeta(tuple(p.shape), full_slices(p.shape))
        if p.is_meta:
            continue  # the dry run's stand-in device holds no values: drawing them would only cost time
        load_global_slice(p, init_slice(seed, name, meta, default_std))


@torch.no_grad()
def load_global_slice(p: torch.Tensor, value: torch.Tensor) -> None:
    """Copy `value` (this rank's real slice) into p, zeroing any padding rows after it."""
    real = tuple(slice(0, n) for n in value.shape)
    p.zero_()
    p[real].copy_(value.to(p.dtype))


def real_part(t: torch.Tensor, meta: ParamMeta) -> torch.Tensor:
    """The local tensor (or its gradient) without padding rows."""
    return t[tuple(slice(0, n) for n in meta.local_real_shape)]


def in_backward() -> bool:
    """True while autograd runs a backward pass: activation recomputation re-runs module forwards there,
    and what a forward does once per step (ZeRO-3 freeing, MoE load counting) must not happen twice.
    (torch has no public query for this; the one private call lives here.)"""
    return torch._C._current_graph_task_id() != -1
