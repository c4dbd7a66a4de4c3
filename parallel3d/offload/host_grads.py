"""parallel.offload_optimizer=cpu: each bucket's reduced gradient streams to the host while backward goes on.

The reducer calls `start(b)` the moment bucket b's reduction is complete (sync.py `_finalize`, i.e. during
backward for every bucket but the last ones); the copy runs on the copy engine (streams.py) while autograd
computes the earlier layers' gradients. What happens to the device gradient after that point is replayed
on the host copy, with the same operations in the same order, so the host gradient is bit-identical to
the device one the step without offload uses:

    device:  reduce -> [start: copy to host] -> tp/embedding all-reduce of some slots -> unscale -> clip
    host:                                      copy those slots again (`refresh`)   -> unscale -> clip

`gradient(b, ...)` (the CPU AdamW step) waits for b's copies only, so bucket k's update can run while
later buckets are still in flight. Host memory: one gradient shard per bucket (in the gradient dtype),
held across steps, pinned when the device is a GPU.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from parallel3d.data_parallel.buffer import Bucket, Slot
from parallel3d.offload.files import host_buffer
from parallel3d.offload.streams import CopyEngine, Ticket


class HostGrads:
    """Host copies of the buckets' reduced gradient shards, filled asynchronously by `engine`."""

    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        self.host: dict[int, torch.Tensor] = {}
        self.tickets: dict[int, list[Ticket]] = {}

    def start(self, b: Bucket) -> None:
        """b's reduction is complete: copy its held gradient to the host, beside the rest of backward."""
        g = b.grad.shard
        host = self.host.get(id(b))
        if host is None or host.numel() != g.numel() or host.dtype != g.dtype:
            host = self.host[id(b)] = host_buffer(g.numel(), g.dtype, self.engine.device.type == "cuda")
        self.tickets[id(b)] = [self.engine.copy(host, g)]

    def refresh(self, b: Bucket, s: Slot) -> None:
        """Slot s of b changed on the device after start(b) (an extra all-reduce): copy its rows again.
        The engine is first in first out, so this copy lands after the whole-bucket one."""
        self.tickets[id(b)].append(self.engine.copy(s.flat(self.host[id(b)]), s.flat(b.grad.shard)))

    @torch.no_grad()
    def gradient(self, b: Bucket, inv_scale: Optional[torch.Tensor], clip_coef: Optional[float]) -> torch.Tensor:
        """b's gradient on the host, as the device holds it after unscaling and clipping."""
        for t in self.tickets.pop(id(b)):
            t.synchronize()
        g = self.host[id(b)]
        if inv_scale is not None:   # the same fused kernel as clip.grad_stats (its overflow flag is not needed)
            found = torch.zeros(1, dtype=torch.float32)
            torch._amp_foreach_non_finite_check_and_unscale_([g], found, inv_scale.to("cpu"))
        if clip_coef is not None:
            g.mul_(clip_coef)       # clip.clip_'s multiplication
        return g

    def drain(self, buckets: Sequence[Bucket]) -> None:
        """Wait for every copy in flight (a skipped step, zero_grad, close)."""
        for b in buckets:
            for t in self.tickets.pop(id(b), []):
                t.synchronize()

    def fence(self) -> None:
        """The device's next in-place change of a held gradient comes after every copy issued so far."""
        for ts in self.tickets.values():
            for t in ts:
                t.wait()
