"""Activation offload (`train.activation_offload=true`): tensors autograd saves for backward leave the
device during forward and come back when backward unpacks them.

    forward:  saved tensor t (device) --pack--> host copy (pinned on CUDA, copied asynchronously)
    backward: host copy --unpack--> t' on the original device (asynchronously; ordered on the stream)

Parameters and views of them (anything whose base requires grad as a leaf) stay where they are: they live for the whole
step anyway. Tensors under `min_bytes` stay too: the copy would cost more than it frees. With activation
checkpointing the recomputed segment's saved tensors go through the same hooks, so offload and selective
or full recomputation combine. On the CPU the copy is real but frees nothing (it exists there so the path
is exercised and tested); the memory drop is on GPUs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch


@dataclass
class ActivationOffload:
    """Saved-tensor hooks plus counters (bytes and tensors moved in the last `scope`)."""
    min_bytes: int = 1 << 14
    offloaded_bytes: int = 0
    offloaded_tensors: int = 0

    def _pack(self, t: torch.Tensor) -> Any:
        base = t if t._base is None else t._base  # a weight's transpose is a view of the parameter
        if (base.requires_grad and base.is_leaf) or t.numel() * t.element_size() < self.min_bytes \
                or t.device.type == "meta":
            return t
        pin = t.device.type == "cuda"
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        self.offloaded_bytes += t.numel() * t.element_size()
        self.offloaded_tensors += 1
        return (t.device, host)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, tuple):
            device, host = packed
            return host.to(device, non_blocking=device.type == "cuda")
        return packed

    @contextlib.contextmanager
    def scope(self) -> Iterator["ActivationOffload"]:
        """Offload what autograd saves inside this block (one training step's forwards and backwards)."""
        self.offloaded_bytes = self.offloaded_tensors = 0
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield self
