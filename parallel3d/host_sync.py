"""Host syncs: every place a training step makes the host wait for the device, counted by category.

On a GPU the host queues kernels ahead of the device; a read of a device value (`.item()`, `.tolist()`,
`.cpu()`) or a blocking copy from pageable host memory to the device makes the host wait until the device
has run everything queued before it, which empties the launch queue and stalls any overlap. On the CPU and
on the dry run's `meta` stand-in these cost nothing, so they are counted instead of timed, and this module
is their one owner:

  - every read of a device value goes through `read_float` / `read_list` / `read_tensor`, which count it in the rank's
    `HostSyncs` (`ctx.stats.syncs`, reset with the communication accounting at each step) under a
    category, on every device: the real value on CUDA and the CPU, the caller's nominal value on the
    meta / fake stand-ins (which have no values). Under `torch.cuda.set_sync_debug_mode("error")` the
    counted reads are the only ones allowed (tests/test_gpu_async.py);
  - host-to-device copies go through `upload`: pinned memory and a non-blocking copy on CUDA (no wait);
    the dry run's tracker counts any other blocking copy onto the stand-in device (`blocking_upload`)
    under "upload".

Categories (`CATEGORIES`):
  step        the step's own decisions: the global target-token count, the loss-scale probe, the gradient
              norm and non-finite flag (clipping, NaN policy, fp16 overflow), the loss. Once per step each.
  logging     values read only to report them: MoE load and auxiliary-loss statistics (once per model chunk),
              the timeline, evaluation.
  moe_splits  drop-less expert dispatch: an all-to-all with uneven splits needs the split sizes on the
              host, so one read per MoE layer forward, as in Megatron and DeepSpeed without a capacity
              factor (full recomputation replays the forward's sizes: MoELayer.recompute_contexts). The
              only category that grows with layers x microbatches.
  checkpoint  the asynchronous checkpoint poll.
  upload      a blocking host-to-device copy (pageable memory): a bug to fix, never expected.

What the dry run cannot see: `torch.tensor(data, device=...)` and `Tensor.new_tensor` copy from the host
below the dispatcher (no dispatch mode sees them); on CUDA they are blocking copies, so the step's code
builds device constants with `torch.full` / `torch.zeros` or uploads host data with `upload`. A CUDA run
under torch.cuda.set_sync_debug_mode("error") catches what review misses (tests/test_gpu_async.py).
"""
from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Sequence

import torch

CATEGORIES = ("step", "logging", "moe_splits", "checkpoint", "upload")
PER_LAYER = ("moe_splits",)  # categories that scale with MoE layers x microbatches



@dataclass
class HostSyncs:
    """Host syncs per category since the last reset (one per rank, on `CommStats.syncs`)."""
    counts: dict = field(default_factory=lambda: defaultdict(int))
    on_read: Optional[Callable[[str], None]] = None   # the strict test backend's check (comm/strict.py)

    def add(self, category: str, n: int = 1) -> None:
        if category not in CATEGORIES:
            raise ValueError(f"unknown host-sync category {category!r}; one of {CATEGORIES}")
        self.counts[category] += n
        if self.on_read is not None:
            self.on_read(category)

    def reset(self) -> None:
        self.counts.clear()

    def summary(self) -> dict[str, int]:
        """{category: count} of the categories that occurred, plus "total" (the JSON / JSONL field)."""
        out = {c: self.counts[c] for c in CATEGORIES if self.counts.get(c)}
        out["total"] = sum(out.values())
        return out


def has_values(t: torch.Tensor) -> bool:
    """False for meta tensors and fake tensors (dry runs): shapes and devices only."""
    if t.device.type == "meta":
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    return not isinstance(t, FakeTensor)


@contextmanager
def _allowed(t: torch.Tensor) -> Iterator[None]:
    """A counted read is allowed under torch.cuda.set_sync_debug_mode("error"): only uncounted ones fail."""
    if not t.is_cuda:
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def read_float(t: torch.Tensor, syncs: Optional[HostSyncs], category: str, nominal: float = 0.0) -> float:
    """float(t) of a one-element tensor (one host sync, counted); `nominal` in a dry run."""
    if syncs is not None:
        syncs.add(category)
    if not has_values(t):
        return float(nominal)
    with _allowed(t):
        return float(t.item())


def read_list(t: torch.Tensor, syncs: Optional[HostSyncs], category: str, nominal: Sequence) -> list:
    """t.tolist() of a 1-D tensor (one host sync, counted; ints stay ints); `nominal` in a dry run."""
    if syncs is not None:
        syncs.add(category)
    if not has_values(t):
        return list(nominal)
    with _allowed(t):
        return t.tolist()


def read_tensor(t: torch.Tensor, syncs: Optional[HostSyncs], category: str) -> torch.Tensor:
    """t copied to the host (one host sync, counted); zeros of its shape and dtype in a dry run."""
    if syncs is not None:
        syncs.add(category)
    if not has_values(t):
        return torch.zeros(t.shape, dtype=t.dtype)
    with _allowed(t):
        return t.cpu()


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without making the host wait: on CUDA staged through pinned memory and
    copied non-blocking (a pageable source makes torch synchronise the stream); elsewhere a plain copy
    (non-blocking too, so the dry run's tracker sees the copy CUDA would make)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device, non_blocking=True)


def blocking_upload(func, args: tuple, kwargs: dict, device_type: str) -> bool:
    """Whether an aten op seen by a dispatch mode is a blocking copy from the host onto `device_type`
    (a host sync on CUDA): the dry run's tracker counts these under "upload"."""
    name = func._overloadpacket.__name__
    if name == "_to_copy":  # t.to(device): _to_copy(src, *, device, non_blocking)
        src, dst, non_blocking = args[0], kwargs.get("device"), kwargs.get("non_blocking", False)
    elif name == "copy_":   # dst.copy_(src, non_blocking)
        src, dst = args[1], args[0].device
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    else:
        return False
    if not isinstance(src, torch.Tensor) or src.device.type != "cpu" or dst is None:
        return False
    return torch.device(dst).type == device_type != "cpu" and not non_blocking
