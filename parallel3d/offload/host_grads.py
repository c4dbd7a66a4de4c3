"""parallel.offload_optimizer=cpu|nvme: each bucket's reduced gradient leaves the device as it completes.

With an offloaded optimizer the optimizer reduces every bucket in every backward (sync.py,
`per_microbatch`), and calls `start(b, g)` the moment bucket b's reduction g is complete (during backward
for every bucket but the last ones). The copy runs on the copy engine (streams.py) while autograd
computes the earlier layers' gradients; the device buffer is released to the copy (the allocator reuses
it once the copy is done), so the device holds only the buckets in flight, whatever the number of
microbatches. Accumulation happens on the host, in the same order the device would add:

    microbatch 1:   host  <- g1                     (copied straight into the held buffer)
    microbatch k:   staging <- gk, then host += staging   (a host thread, after the copy has landed)

From `finish` on, the host buffers are the held gradients (`b.grad.shard`): the tp/embedding sums,
unscaling, the norm, clipping and AdamW (or the NVMe stream) all run on them, so nothing is replayed and
the result is the device step's arithmetic. Host memory: one gradient per bucket (the rank's segment,
ZeRO-0 the whole bucket) plus one staging buffer, held across steps, pinned when the device is a GPU.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Sequence

import torch

from parallel3d.data_parallel.buffer import Bucket
from parallel3d.offload.files import host_buffer
from parallel3d.offload.streams import CopyEngine, Ticket


class HostGrads:
    """Host copies of the buckets' reduced gradients, filled and accumulated asynchronously."""

    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        self.pin = engine.device.type == "cuda"
        self.host: dict[int, torch.Tensor] = {}
        self.staging: dict[int, torch.Tensor] = {}
        self.tickets: dict[int, list[Ticket]] = {}
        self.filled: set[int] = set()   # buckets whose host gradient holds this step's first reduction
        self.adder = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-grad-add")

    def _buffer(self, table: dict, b: Bucket, g: torch.Tensor) -> torch.Tensor:
        t = table.get(id(b))
        if t is None or t.numel() != g.numel() or t.dtype != g.dtype:
            t = table[id(b)] = host_buffer(g.numel(), g.dtype, self.pin)
        return t

    def start(self, b: Bucket, g: torch.Tensor) -> None:
        """g: b's reduced gradient of one backward, on the device; the caller drops it (the copy keeps
        what it needs). The first of the step lands in the held buffer, later ones are added to it."""
        if id(b) not in self.filled:
            self.tickets[id(b)] = [self.engine.copy(self._buffer(self.host, b, g), g, release_source=True)]
            self.filled.add(id(b))
            return
        for t in self.tickets.pop(id(b), []):   # the staging buffer's last add is done (it was long ago)
            t.synchronize()
        host, staging = self.host[id(b)], self._buffer(self.staging, b, g)
        copied = self.engine.copy(staging, g, release_source=True)

        def add() -> None:
            copied.synchronize()
            with torch.no_grad():
                host.add_(staging)
        self.tickets[id(b)] = [Ticket(future=self.adder.submit(add))]

    def finish(self, buckets: Sequence[Bucket]) -> None:
        """Every copy and add of the step done: the host buffers become the held gradients."""
        self.drain(buckets)
        for b in buckets:
            b.grad.shard = self.host[id(b)]

    def drain(self, buckets: Sequence[Bucket]) -> None:
        """Wait for every copy and add in flight (the step, a skipped step, zero_grad, close)."""
        for b in buckets:
            for t in self.tickets.pop(id(b), []):
                t.synchronize()

    def reset(self, buckets: Sequence[Bucket]) -> None:
        """A new step: the next reduction of every bucket starts its host gradient afresh."""
        self.drain(buckets)
        self.filled.clear()

    def close(self) -> None:
        self.adder.shutdown(wait=True)
