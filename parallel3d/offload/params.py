"""parallel.offload_params=cpu|nvme (ZeRO-3): a unit's persistent parameter shard lives off the device.

ZeRO-3 keeps, per unit bucket, a 1/N shard of the parameters in the compute dtype (`Bucket.param_flat`)
and all-gathers it around the unit's forward and backward (data_parallel/zero3.py). With parameter
offload that shard's home is host memory (pinned when the device is a GPU) or this rank's params file
under parallel.offload_dir; ZeRO-3 calls `fetch(b)` when it starts a gather -- for the next unit too,
since its prefetcher starts the next unit's gather while the current one computes -- and drops the
device copy once the gathered parameters are written out. The optimizer writes updated weights back
with `store` (chunk by chunk, as the AdamW step produces them).

    device memory per unit: the gathered parameters while in use (as ZeRO-3), plus its shard only
    while the gather is in flight; between uses nothing.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from parallel3d.data_parallel.buffer import Bucket
from parallel3d.mesh import ParallelContext
from parallel3d.offload.files import OffloadError, StateFiles, create_on_every_rank, host_buffer


class ParamOffload:
    """Homes of the ZeRO-3 parameter shards: `mode` cpu (host tensors) or nvme (one file per rank)."""

    def __init__(self, buckets: Sequence[Bucket], mode: str, dtype: torch.dtype, device: torch.device,
                 root: Optional[str] = None, rank: int = 0, chunk: int = 1 << 20) -> None:
        self.mode, self.dtype, self.device = mode, dtype, torch.device(device)
        self.pin = self.device.type == "cuda"
        self.host: dict[int, torch.Tensor] = {}
        self.base: dict[int, int] = {}
        self.files = None
        if mode == "cpu":
            for b in buckets:
                self.host[id(b)] = host_buffer(b.seg, dtype, self.pin)
        else:
            total = 0
            for b in buckets:
                self.base[id(b)] = total
                total += b.seg
            self.elem = torch.finfo(dtype).bits // 8
            self.files = StateFiles(root, rank, {"params": total * self.elem}, tag="params")
            self.chunk = chunk
            self.staging = host_buffer(min(chunk, max(total, 1)), dtype, self.pin)

    @classmethod
    def create(cls, buckets: Sequence[Bucket], mode: str, dtype: torch.dtype, ctx: ParallelContext,
               root: Optional[str]) -> "ParamOffload":
        """Homes for the ZeRO-3 buckets' shards, filled from `param_flat`, which then leaves the device."""
        def build() -> "ParamOffload":
            home = cls(buckets, mode, dtype, ctx.device, root, ctx.rank)
            try:
                for b in buckets:
                    home.store(b, 0, b.seg, b.param_flat)
            except OffloadError:
                home.close()
                raise
            return home
        home = create_on_every_rank(ctx, build)
        for b in buckets:
            b.param_flat = None
        return home

    def close(self) -> None:
        if self.files is not None:
            self.files.close()

    def _offset(self, b: Bucket, a: int) -> int:
        return (self.base[id(b)] + a) * self.elem

    @torch.no_grad()
    def store(self, b: Bucket, a: int, e: int, values: torch.Tensor) -> None:
        """Elements [a, e) of b's shard <- values (any dtype and device; converted to the compute dtype)."""
        if self.mode == "cpu":
            self.host[id(b)][a:e].copy_(values)
            return
        for i in range(a, e, self.chunk):
            j = min(i + self.chunk, e)
            part = self.staging[: j - i].copy_(values[i - a: j - a])
            self.files.write("params", self._offset(b, i), part)

    @torch.no_grad()
    def fetch(self, b: Bucket) -> torch.Tensor:
        """b's shard on the device (the all-gather's input)."""
        if self.mode == "cpu":
            return self.host[id(b)].to(self.device, non_blocking=self.pin)
        out = torch.empty(b.seg, dtype=self.dtype, device=self.device)
        for i in range(0, b.seg, self.chunk):
            j = min(i + self.chunk, b.seg)
            part = self.files.read("params", self._offset(b, i), self.staging[: j - i])
            out[i:j].copy_(part)  # synchronous: the staging buffer is reused by the next chunk
        return out

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())
