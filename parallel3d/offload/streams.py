"""The copy engine: host <-> device copies that run beside compute, and the tickets that order their consumers.

Every offload transfer (a reduced gradient bucket to the host, an updated parameter bucket back, a ZeRO-3
shard fetched ahead of its unit) goes through one `CopyEngine.copy(dst, src)`, which returns a `Ticket`;
whoever uses `dst` (or reuses `src`) first calls the ticket's `wait()` (the consumer is the device: the
current stream waits) or `synchronize()` (the consumer is host code: the calling thread waits).

    CUDA  one side torch.cuda.Stream per engine. copy(): the side stream waits for the issuing point
          (`after`, by default an event recorded now on the caller's current stream, so a just-allocated
          destination or a just-computed source is ready), copies non_blocking between pinned host memory
          and the device, records an event. Device tensors are `record_stream`ed on the side stream (the
          caching allocator does not hand their memory out again before the copy is done); the ticket keeps
          both tensors alive. wait() = current_stream.wait_event (the host does not block).
    CPU   one worker thread, first in first out like a stream (torch's copy releases the GIL, so the copy
          really overlaps the main thread). copy() submits dst.copy_(src); wait() and synchronize() join it.
    synchronous=True (either device): the copy is done inside copy(); the tickets are already complete.
          Benchmarks use it to measure what the overlap buys (benchmarks/offload.py overlap).

The callers' control flow is the same on every device: only the primitive behind copy() and wait() differs,
so the CPU tests exercise the ordering that CUDA relies on.
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Optional

import torch


def check_copy(device: torch.device, dst: torch.Tensor, src: torch.Tensor) -> None:
    """Refuse a pair the asynchronous path cannot copy safely (one clear ValueError naming the problem).

    Both tensors live on `device` or on the host; same dtype and element count (a conversion inside a
    non_blocking host->device copy stages through pageable memory: callers convert on the host first).
    On CUDA a host side must be pinned: a non_blocking copy from pageable memory is silently synchronous,
    and one into pageable memory can be read by the host before it lands."""
    for role, t in (("destination", dst), ("source", src)):
        other_index = device.index is not None and t.device.index not in (None, device.index)
        if t.device.type not in ("cpu", device.type) or (t.device.type != "cpu" and other_index):
            raise ValueError(f"copy engine on {device}: the {role} is on {t.device} (expected {device} or the host)")
        if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
            raise ValueError(f"copy engine on {device}: the {role} is a host tensor that is not pinned; "
                             f"asynchronous copies need pinned host buffers (offload/files.host_buffer)")
    if dst.dtype != src.dtype or dst.numel() != src.numel():
        raise ValueError(f"copy engine: {tuple(src.shape)} {src.dtype} -> {tuple(dst.shape)} {dst.dtype}: the "
                         f"two sides must have the same dtype and size")


class Ticket:
    """One issued copy (or a completed one). Keeps its tensors alive until it is waited for."""

    def __init__(self, event: Any = None, future: Optional[cf.Future] = None, keep: tuple = (),
                 device: Optional[torch.device] = None) -> None:
        self.event, self.future, self.keep, self.device = event, future, keep, device

    def wait(self) -> None:
        """Order the device after the copy (CUDA: the current stream waits; CPU: the caller waits)."""
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
        if self.future is not None:
            self.future.result()

    def synchronize(self) -> None:
        """Block the calling thread until the copy is done (the consumer is host code)."""
        if self.event is not None:
            self.event.synchronize()
        if self.future is not None:
            self.future.result()
        self.keep = ()

    def done(self) -> bool:
        if self.event is not None:
            return self.event.query()
        return self.future is None or self.future.done()


class CopyEngine:
    """Asynchronous copies between host memory and `device` (see the module docstring)."""

    def __init__(self, device: torch.device, synchronous: bool = False) -> None:
        self.device = torch.device(device)
        self.synchronous = synchronous
        self.stream = self.worker = None
        if synchronous:
            pass
        elif self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
        elif self.device.type == "cpu":
            self.worker = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="copy-engine")
        else:
            raise ValueError(f"copy engine: no asynchronous copies on {self.device} (the meta-device stand-in "
                             f"has no host memory: offload is refused there)")

    def mark(self) -> Any:
        """The current point of the calling thread's work on the device (a CUDA event on its current
        stream; None elsewhere): pass it as `after` to copies issued later from another thread."""
        if self.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: Any = None, release_source: bool = False) -> Ticket:
        """dst <- src, beside the caller's work; `after`: a mark() the copy must follow (default: now).
        release_source: the ticket does not keep `src` alive (the caller drops it to free device memory;
        on CUDA record_stream keeps the allocator from reusing it before the copy is done)."""
        check_copy(self.device, dst, src)
        if self.synchronous:
            dst.copy_(src)
            return Ticket()
        if self.worker is not None:
            return Ticket(future=self.worker.submit(_copy, dst, src), keep=(dst,) if release_source else (dst, src))
        start = after if after is not None else self.mark()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):   # also from I/O threads
            self.stream.wait_event(start)
            dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if t.device.type == "cuda":  # the allocator must not reuse it before the side stream is done
                    t.record_stream(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        return Ticket(event=done, keep=(dst,) if release_source else (dst, src), device=self.device)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.shutdown(wait=True)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src)


class Fetched:
    """A tensor being filled for the device: `future` (host work, e.g. NVMe reads on I/O threads; its
    result is a list of tickets) and/or `tickets` (copies). wait() orders the device after all of it
    and returns the tensor; the host blocks only for host work that is not done yet."""

    def __init__(self, tensor: torch.Tensor, tickets: tuple = (), future: Optional[cf.Future] = None) -> None:
        self.tensor, self.tickets, self.future = tensor, list(tickets), future

    def wait(self) -> torch.Tensor:
        if self.future is not None:
            self.tickets += self.future.result()
            self.future = None
        for t in self.tickets:
            t.wait()
        self.tickets = []
        return self.tensor
