"""parallel.offload_params=cpu|nvme (ZeRO-3): a unit's persistent parameter shard lives off the device.

ZeRO-3 keeps, per unit bucket, a 1/N shard of the parameters in the compute dtype (`Bucket.param_flat`)
and all-gathers it around the unit's forward and backward (data_parallel/zero3.py). With parameter
offload that shard's home is host memory (pinned when the device is a GPU) or this rank's params file
under parallel.offload_dir; ZeRO-3's prefetcher calls `fetch(b)` two units ahead of use (zero3.py: while
unit i computes, unit i+1's gather is in flight and unit i+2's shard is being fetched); fetch only issues
the transfer and returns a `Fetched` (streams.py), which the gather waits for when it starts:

    cpu    a copy engine copy, pinned host buffer -> device (a side stream on CUDA)
    nvme   a read on this home's I/O thread: the file streams through two pinned staging chunks, each
           copied to the device on the copy engine while the next one is read (read-ahead); the main
           thread blocks only if the read is not done when the gather needs it

The device copy is dropped once the gathered parameters are written out. The optimizer writes updated
weights back with `store` (chunk by chunk, as the AdamW step produces them), after ZeRO-3 dropped every
fetch in flight (finish_grad_sync frees all units).

    device memory per unit: the gathered parameters while in use (as ZeRO-3), plus its shard from its
    fetch (two units ahead) to its gather; between uses nothing. Host memory (nvme): three chunks.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Optional, Sequence

import torch

from parallel3d.data_parallel.buffer import Bucket
from parallel3d.mesh import ParallelContext
from parallel3d.offload.files import OffloadError, StateFiles, create_on_every_rank, host_buffer
from parallel3d.offload.streams import CopyEngine, Fetched, Ticket

READ_SLOTS = 2     # staging chunks of a fetch: one being read, one being copied to the device


class ParamOffload:
    """Homes of the ZeRO-3 parameter shards: `mode` cpu (host tensors) or nvme (one file per rank)."""

    def __init__(self, buckets: Sequence[Bucket], mode: str, dtype: torch.dtype, device: torch.device,
                 root: Optional[str] = None, rank: int = 0, chunk: int = 1 << 20,
                 engine: Optional[CopyEngine] = None) -> None:
        self.mode, self.dtype, self.device = mode, dtype, torch.device(device)
        self.pin = self.device.type == "cuda"
        self.engine = engine or CopyEngine(self.device)
        self.io = None
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
            self.staging = host_buffer(min(chunk, max(total, 1)), dtype, self.pin)   # store's
            self.ring = [host_buffer(min(chunk, max(total, 1)), dtype, self.pin) for _ in range(READ_SLOTS)]
            self.io = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvme-params")  # reads in order

    @classmethod
    def create(cls, buckets: Sequence[Bucket], mode: str, dtype: torch.dtype, ctx: ParallelContext,
               root: Optional[str], engine: Optional[CopyEngine] = None) -> "ParamOffload":
        """Homes for the ZeRO-3 buckets' shards, filled from `param_flat`, which then leaves the device."""
        def build() -> "ParamOffload":
            home = cls(buckets, mode, dtype, ctx.device, root, ctx.rank, engine=engine)
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
        if self.io is not None:
            self.io.shutdown(wait=True)
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
    def fetch(self, b: Bucket) -> Fetched:
        """Start bringing b's shard to the device (the all-gather's input); wait() on the result gives it."""
        out = torch.empty(b.seg, dtype=self.dtype, device=self.device)   # (S,)
        if self.mode == "cpu":
            return Fetched(out, [self.engine.copy(out, self.host[id(b)])])
        return Fetched(out, future=self.io.submit(self._read, b, out, self.engine.mark()))

    @torch.no_grad()
    def _read(self, b: Bucket, out: torch.Tensor, after) -> list[Ticket]:
        """On the I/O thread: chunk k is read into a staging buffer while chunk k-1 is copied from the other
        one; a buffer is reused once its copy is done. Returns the tickets still in flight."""
        pending: list[Optional[Ticket]] = [None] * READ_SLOTS
        for k, i in enumerate(range(0, b.seg, self.chunk)):
            j = min(i + self.chunk, b.seg)
            if pending[k % READ_SLOTS] is not None:
                pending[k % READ_SLOTS].synchronize()
            part = self.files.read("params", self._offset(b, i), self.ring[k % READ_SLOTS][: j - i])
            pending[k % READ_SLOTS] = self.engine.copy(out[i:j], part, after=after)
        return [t for t in pending if t is not None]

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.host.values())
