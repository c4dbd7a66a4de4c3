"""Updated parameters back to the device after the CPU AdamW step, without making the next forward wait for all.

The offloaded step updates bucket after bucket on the host (forward order: the first layers' buckets first);
each bucket's new values leave on the copy engine (streams.py) as soon as its update is done, while the
host updates the next bucket. Who reads a bucket's device parameters first waits for that bucket only:

    ZeRO-0     the forward pre-hook of the block (or chunk) holding its parameters (`hooks`)
    ZeRO-1/2   the bucket's all-gather (publishing.ParamPublisher); with overlap_param_gather the
               gather itself is waited for by the first block holding it (`bucket_hooks`, publishing.py)
    ZeRO-3     the unit's gather, through the prefetcher's fetch (zero3.py), one unit ahead of use

`wait_all` is the backstop for any other reader (checkpoints, the end of the backward pass).
A conversion to the compute dtype happens on the host, into a pinned staging buffer (a non_blocking copy
that converts would stage through pageable memory): per bucket here, or a slot of the NVMe pool.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
from torch import nn

from parallel3d.data_parallel.buffer import Bucket
from parallel3d.offload.files import host_buffer
from parallel3d.offload.streams import CopyEngine, Ticket


class DevicePublish:
    """Per-bucket tickets of the parameter copies in flight (see the module docstring)."""

    def __init__(self, engine: CopyEngine) -> None:
        self.engine = engine
        self.tickets: dict[int, list[Ticket]] = {}
        self.staging: dict[int, torch.Tensor] = {}
        self.last: dict[int, Ticket] = {}        # the copy that last read a bucket's own staging buffer

    @torch.no_grad()
    def copy(self, b: Bucket, dst: torch.Tensor, values: torch.Tensor,
             staging: Optional[torch.Tensor] = None) -> Ticket:
        """dst (device, compute dtype) <- values (host fp32). `staging`: a pinned host buffer of at least
        dst's bytes that the caller keeps until the ticket completes; default: the bucket's own."""
        src = values
        if values.dtype != dst.dtype:
            n = dst.numel()
            if staging is None:
                if id(b) in self.last:                  # the bucket's buffer may still be being read
                    self.last.pop(id(b)).synchronize()
                staging = self.staging.get(id(b))
                if staging is None or staging.numel() < n * dst.element_size():
                    staging = self.staging[id(b)] = host_buffer(n * dst.element_size(), torch.uint8,
                                                                self.engine.device.type == "cuda")
            src = staging.view(torch.uint8)[: n * dst.element_size()].view(dst.dtype).copy_(values)
        ticket = self.engine.copy(dst, src)
        self.tickets.setdefault(id(b), []).append(ticket)
        if src is not values and staging is self.staging.get(id(b)):
            self.last[id(b)] = ticket
        return ticket

    def take(self, b: Bucket) -> list[Ticket]:
        """b's copies in flight, handed to a consumer that waits for them later (ZeRO-3's gather)."""
        return self.tickets.pop(id(b), [])

    def wait(self, b: Bucket) -> None:
        """The device's next use of b's parameters comes after its copies."""
        for t in self.tickets.pop(id(b), []):
            t.wait()

    def wait_all(self) -> None:
        for key in list(self.tickets):
            for t in self.tickets.pop(key):
                t.wait()

    def hooks(self, buckets: Sequence[Bucket], modules: Sequence[nn.Module]) -> list:
        """ZeRO-0: a forward pre-hook on each module owning parameters of `buckets` waits for their buckets."""
        return bucket_hooks(buckets, modules, lambda b: self.wait(b) if id(b) in self.tickets else None)


def bucket_hooks(buckets: Sequence[Bucket], modules: Sequence[nn.Module], wait: Callable[[Bucket], None]) -> list:
    """A forward pre-hook on each block holding parameters of `buckets` (and on the chunk, for those outside
    the blocks) calls wait(b) for each of its buckets: whatever brings a bucket's parameters up to date (a
    copy, an all-gather) is waited for by its first reader only. Returns the hook handles."""
    from parallel3d.data_parallel.zero3 import find_units

    owner = {id(s.param): b for b in buckets for s in b.slots}
    handles = []
    for root in modules:
        # parameters outside the blocks (embedding, final norm, head) may be read without their module's
        # forward (the fused head reads lm_head.weight): the chunk's own forward waits for those
        in_blocks = {id(p) for unit in find_units(root) for p in unit.parameters()}
        outside = {id(owner[id(p)]): owner[id(p)] for p in root.parameters()
                   if id(p) in owner and id(p) not in in_blocks}
        if outside:
            handles.append(root.register_forward_pre_hook(_waiter(list(outside.values()), wait)))
        # each block waits for every bucket of its parameters: inside a block, weights may be read without
        # their module's forward (the fused SP entry, tensor_parallel.column_entry, reads q/k/v's and
        # gate/up's), so a wait hung on the owning module would not fire
        for unit in find_units(root):
            mine = {id(owner[id(p)]): owner[id(p)] for p in unit.parameters() if id(p) in owner}
            if mine:
                handles.append(unit.register_forward_pre_hook(_waiter(list(mine.values()), wait)))
    return handles


def _waiter(bs: list[Bucket], wait: Callable[[Bucket], None]):
    def hook(module, args):
        for b in bs:
            wait(b)
    return hook
