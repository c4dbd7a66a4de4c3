"""Activation offload (`train.activation_offload=true`): tensors autograd saves for backward leave the
device during forward and come back ahead of the backward that needs them.

    forward:  saved tensor t --pack--> copy to a host buffer issued on the copy engine (streams.py): it runs
              beside the forward (CUDA: a side stream; the caching allocator keeps t's memory until the
              copy is done, and t itself is dropped at once, which is what frees the device)
    backward: unpack(record j) waits only for record j's copy up; before that it issues the copies up of
              the rest of j's block and of the block saved before it (backward unpacks in about the reverse
              of pack order), at most `prefetch_bytes`, so the next block's activations travel while this
              one computes. Blocks are the units `attach` is given (the trainer passes each chunk's
              transformer blocks; their forward hooks number the groups); without them it is one group.

A tensor still alive at unpack (something else held it, e.g. the pipeline's received input) comes back as
itself: the device never freed it, so a copy up would only double it. If it was modified in place since
pack, unpack raises as autograd does without hooks (the copy down may have read either value).

Parameters and views of them (anything whose base requires grad as a leaf) stay where they are: they live
for the whole step anyway. Tensors under `min_bytes` stay too: the copy would cost more than it frees. With
activation checkpointing the recomputed segment's saved tensors go through the same hooks, so offload and
selective or full recomputation combine. On the CPU the copy is real but frees nothing (it exists there so
the path, ordering included, is exercised and tested); the memory drop is on GPUs. On the `meta` stand-in
(the planner's dry run) nothing can be copied: a record keeps only the shape, the device tensor is dropped
all the same and unpack allocates it again, so the dry run's memory tracker sees what a GPU would.
"""
from __future__ import annotations

import contextlib
import weakref
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
    host: Optional[torch.Tensor]        # (numel,) flat host buffer; None on the meta stand-in
    dtype: torch.dtype
    numel: int
    down: Ticket
    up: Optional[tuple[torch.Tensor, Ticket]] = None
    used: bool = False                  # unpacked once: prefetching skips it
    original: Optional[weakref.ref] = None  # the device tensor; alive at unpack when something else held it
    version: int = 0
    group: int = 0                      # the block (forward-hook count) it was saved in

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def held(self) -> Optional[torch.Tensor]:
        """The device tensor if something else still holds it unchanged (None: gone, or modified since)."""
        t = self.original() if self.original is not None else None
        return t if t is not None and t._version == self.version else None

    def check_unmodified(self) -> None:
        t = self.original() if self.original is not None else None
        if t is not None and t._version != self.version:
            raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: {tuple(self.shape)} {self.dtype}, saved at version "
                               f"{self.version}, now {t._version} (train.activation_offload)")

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
    _group: int = 0

    def attach(self, blocks) -> list:
        """Number the groups by these modules' forwards (each block, and what runs between two blocks, is a
        group). Returns the hook handles."""
        def bump(*_):
            self._group += 1
        return [h for b in blocks for h in (b.register_forward_pre_hook(bump), b.register_forward_hook(bump))]

    def _engine(self, device: torch.device) -> CopyEngine:
        if device not in self._engines:
            self._engines[device] = CopyEngine(device, synchronous=self.synchronous)
        return self._engines[device]

    def _pack(self, t: torch.Tensor) -> Any:
        base = t if t._base is None else t._base  # a weight's transpose is a view of the parameter
        if (base.requires_grad and base.is_leaf) or t.numel() * t.element_size() < self.min_bytes \
                or t.layout != torch.strided:
            return t
        rec = _Saved(len(self._saved), t.device, t.shape, None, t.dtype, t.numel(), Ticket(),
                     original=weakref.ref(t), version=t._version, group=self._group)
        if t.device.type != "meta":
            src = t.detach().contiguous().view(-1)    # (numel,)
            rec.host = host_buffer(src.numel(), t.dtype, pin=t.device.type == "cuda")
            rec.down = self._engine(t.device).copy(rec.host, src, release_source=True)  # t may go at once
        self._saved.append(weakref.ref(rec))  # the graph owns the record: a branch backward never reaches
        self.offloaded_bytes += rec.nbytes
        self.offloaded_tensors += 1
        return rec

    def _fetch(self, rec: _Saved) -> None:
        """Issue rec's copy up (after its copy down: the engine is first in, first out)."""
        dev = torch.empty(rec.numel, dtype=rec.dtype, device=rec.device)  # (numel,)
        rec.up = (dev, Ticket() if rec.host is None else self._engine(rec.device).copy(dev, rec.host))
        self.fetch_log.append(rec.index)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Saved):
            return packed
        packed.check_unmodified()                   # only the record being unpacked: others may never be
        if (kept := packed.held()) is not None:     # never freed (module docstring)
            packed.up, packed.used = None, True
            return kept
        if packed.up is None:
            self._fetch(packed)
        ahead, previous = 0, None                    # the records backward reaches next: this group's
        for ref in reversed(self._saved[: packed.index]):   # rest, then the group saved before it
            rec = ref()
            if rec is None or rec.used or rec.held() is not None:  # freed with its graph, consumed, or
                continue                                           # still on the device anyway
            if rec.group != packed.group:
                previous = rec.group if previous is None else previous
                if rec.group != previous:
                    break
            if ahead + rec.nbytes > self.prefetch_bytes:
                break
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
            self._saved = []
