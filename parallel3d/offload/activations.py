"""Activation offload (`train.activation_offload=true`): tensors autograd saves for backward leave the
device during forward and come back ahead of the backward that needs them.

    forward:  saved tensor t --pack--> copy to a host buffer issued on the copy engine (streams.py): it runs
              beside the forward (CUDA: a side stream; the caching allocator keeps t's memory until the
              copy is done, and t itself is dropped at once, which is what frees the device)
    backward: unpack(record j) waits only for record j's copy up; before that it issues the copies up of
              the records saved just before j (backward unpacks in about the reverse of pack order), up
              to `prefetch_bytes` ahead, so the next layers' activations travel while this one computes

Parameters and views of them (anything whose base requires grad as a leaf) stay where they are: they live
for the whole step anyway. Tensors under `min_bytes` stay too: the copy would cost more than it frees. With
activation checkpointing the recomputed segment's saved tensors go through the same hooks, so offload and
selective or full recomputation combine. On the CPU the copy is real but frees nothing (it exists there so
the path, ordering included, is exercised and tested); the memory drop is on GPUs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch

from parallel3d.offload.files import host_buffer
from parallel3d.offload.streams import CopyEngine, Ticket


@dataclass(eq=False)
class _Saved:
    """One offloaded tensor: its host copy, the copy down, and (once prefetched) the device copy coming up."""
    index: int
    device: torch.device
    shape: torch.Size
    host: torch.Tensor                  # (numel,) flat host buffer
    down: Ticket
    up: Optional[tuple[torch.Tensor, Ticket]] = None
    used: bool = False                  # unpacked once: prefetching skips it

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


@dataclass
class ActivationOffload:
    """Saved-tensor hooks plus counters (bytes and tensors moved in the last `scope`) and the fetch log
    (record indices in the order their copies up were issued: what the prefetch test reads)."""
    min_bytes: int = 1 << 14
    prefetch_bytes: int = 256 << 20
    synchronous: bool = False           # every copy inside the hook (benchmarks: what the overlap buys)
    offloaded_bytes: int = 0
    offloaded_tensors: int = 0
    fetch_log: list = field(default_factory=list)
    _saved: list = field(default_factory=list)
    _engines: dict = field(default_factory=dict)

    def _engine(self, device: torch.device) -> CopyEngine:
        if device not in self._engines:
            self._engines[device] = CopyEngine(device, synchronous=self.synchronous)
        return self._engines[device]

    def _pack(self, t: torch.Tensor) -> Any:
        base = t if t._base is None else t._base  # a weight's transpose is a view of the parameter
        if (base.requires_grad and base.is_leaf) or t.numel() * t.element_size() < self.min_bytes \
                or t.device.type == "meta" or t.layout != torch.strided:
            return t
        src = t.detach().contiguous().view(-1)    # (numel,)
        host = host_buffer(src.numel(), t.dtype, pin=t.device.type == "cuda")
        rec = _Saved(len(self._saved), t.device, t.shape, host, Ticket())
        rec.down = self._engine(t.device).copy(host, src, release_source=True)  # t may go at once
        self._saved.append(rec)
        self.offloaded_bytes += rec.nbytes
        self.offloaded_tensors += 1
        return rec

    def _fetch(self, rec: _Saved) -> None:
        """Issue rec's copy up (after its copy down: the engine is first in, first out)."""
        dev = torch.empty(rec.host.numel(), dtype=rec.host.dtype, device=rec.device)  # (numel,)
        rec.up = (dev, self._engine(rec.device).copy(dev, rec.host))
        self.fetch_log.append(rec.index)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        if packed.up is None:
            self._fetch(packed)
        ahead = 0                                    # the records backward reaches next
        for rec in reversed(self._saved[: packed.index]):
            if ahead >= self.prefetch_bytes:
                break
            if rec.used:
                continue
            if rec.up is None:
                self._fetch(rec)
            ahead += rec.nbytes
        dev, ticket = packed.up
        ticket.wait()
        packed.up, packed.used = None, True          # a second unpack (retain_graph) fetches again
        return dev.view(packed.shape)

    @contextlib.contextmanager
    def scope(self) -> Iterator["ActivationOffload"]:
        """Offload what autograd saves inside this block (one training step's forwards and backwards)."""
        self.offloaded_bytes = self.offloaded_tensors = 0
        self._saved, self.fetch_log = [], []
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._saved = []                         # the host copies go with the step's graph
