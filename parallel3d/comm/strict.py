"""Work handles, and the strict test backend: NCCL's rules kept on CPU.

Every `comm.start_*` returns a work handle, whatever the group and path: a real collective's, a dry run's
`SimulatedWork`, or a `LocalWork` where this rank wrote the result itself on the current stream (a size-1
group; a blocking path such as qgZ's or compression's). Waiting for a handle is the one rule of ordering
(owned here): on CUDA it makes the waiting stream wait for the stream that produced the result (NCCL's own
work does that for its stream; `LocalWork` through an event recorded where its output was written), so a
side stream that follows a reduction up (data_parallel/sync.py) reads the output only after it is written.

gloo hides what NCCL punishes: its waits block the host, so nothing runs early. `StrictLedger` (one per rank,
on `CommStats.strict`; `ParallelContext.build(strict=True)`, the test harness's strict worlds) makes a gloo
run as strict as NCCL where gloo is loose:

  - an async collective's output holds NaN (integers: their maximum) until its handle is waited: the
    collective runs into a private buffer, copied out on wait, so a read that skipped its wait sees NaN;
  - a process group's collectives complete in issue order: waiting for one first completes every earlier
    one on that process group (groups that share a process group share one queue, as NCCL communicators);
  - a host read (host_sync's counted reads) is reported when the current stream was made to wait behind
    work that the program has still not waited for: a blocking collective, or a wait out of issue order, on
    a process group with earlier work in flight; on NCCL the read would hold the host until that work lands
    (`reports`, with the ops). Work the program waited for before the read is no stall of the read's.
  - `orders_on_device` is true for its groups, so code takes NCCL's paths (the gradient sync's follow-ups
    queued right after each launch) and shows their faults here.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch


class LocalWork:
    """A finished collective's handle: its output was written on the current stream when this was made. On
    CUDA an event recorded there; wait() makes the waiting stream wait for it (nothing on other devices)."""

    def __init__(self, device: torch.device) -> None:
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(device))

    def is_completed(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> bool:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return True


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with what no correct read may see: NaN, or an integer dtype's maximum."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max if t.dtype != torch.bool else True)


class StrictWork:
    """A strict group's handle: `work` runs into private buffers; wait() completes the queue up to it in
    issue order, then copies each private buffer into the output the caller sees (NaN until then)."""

    def __init__(self, ledger: "StrictLedger", queue: object, label: str, work: object,
                 reveal: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.ledger, self.queue, self.label, self.work, self.reveal = ledger, queue, label, work, reveal
        self.done = False      # the underlying collective completed (its turn in the queue came)
        self.waited = False    # the caller waited: the output holds the result

    def _complete(self) -> None:
        if not self.done:
            self.work.wait()
            self.done = True

    def is_completed(self) -> bool:
        earlier = self.ledger.earlier(self.queue, self)
        return all(w.done or w.work.is_completed() for w in earlier + [self])

    def wait(self) -> bool:
        if self.waited:
            return True
        earlier = self.ledger.earlier(self.queue, self)
        for w in earlier:          # NCCL: a wait orders behind everything issued before on the communicator
            w._complete()
        if any(not w.waited for w in earlier):
            self.ledger.behind(f"wait for {self.label}", [w for w in earlier if not w.waited])
        self._complete()
        for seen, private in self.reveal:
            seen.copy_(private)
        self.reveal, self.waited = [], True
        self.ledger.retire(self.queue, self)
        return True


class StrictLedger:
    """One rank's strict bookkeeping: handles in flight per process group (issue order) and the host reads
    that would have waited behind them on NCCL (`reports`)."""

    def __init__(self) -> None:
        self.inflight: dict[int, list[StrictWork]] = {}
        self.pending: list[tuple[str, list]] = []   # (why, works) the current stream now waits behind
        self.reports: list[str] = []

    @staticmethod
    def queue_of(group) -> object:
        """Groups on one process group share its queue (as collectives on one NCCL communicator); a result
        this rank wrote itself (a size-1 group) is in no queue: its handle is the compute stream's own order."""
        return id(group.pg) if group.pg is not None and group.size > 1 else None

    def earlier(self, queue: object, work: StrictWork) -> list[StrictWork]:
        q = self.inflight.get(queue, [])
        return q[:q.index(work)] if work in q else []

    def retire(self, queue: object, work: StrictWork) -> None:
        q = self.inflight.get(queue, [])
        if work in q and all(w.waited for w in q[:q.index(work) + 1]):
            while q and q[0].waited:
                q.pop(0)

    def behind(self, what: str, works: list[StrictWork]) -> None:
        """The current stream now waits behind `works` (issue order): a host read while any of them is still
        unwaited by the program would, on NCCL, hold the host until it lands."""
        self.pending.append((what, works))

    def start(self, group, op: str, run: Callable[[list[torch.Tensor]], object],
              outputs: list[torch.Tensor], inputs: Optional[list[torch.Tensor]] = None) -> StrictWork:
        """Run `run(privates)` (the collective into private copies of `outputs`; inputs that alias an output
        are passed as the same view of its private copy) and poison what the caller sees until its wait."""
        privates = [o.clone() for o in outputs]
        args = []
        for t in inputs or []:
            args.append(next((_same_view(t, o, p) for o, p in zip(outputs, privates)
                              if torch._C._is_alias_of(t, o)), t))
        work = run(privates, args)
        for o in outputs:
            block = next((t for t in inputs or [] if torch._C._is_alias_of(t, o) and t.numel() < o.numel()), None)
            keep = block.clone() if block is not None else None
            poison_(o)
            if block is not None:   # an in-place gather: this rank's own block stays, as NCCL leaves it
                block.copy_(keep)
        queue = self.queue_of(group)
        label = f"{op} on {group.name} group {group.ranks}"
        handle = StrictWork(self, queue, label, work, list(zip(outputs, privates)))
        if queue is not None:
            self.inflight.setdefault(queue, []).append(handle)
        return handle

    def blocking(self, group, op: str) -> None:
        """A blocking collective is issued: on NCCL the stream now waits behind the group's earlier work."""
        q = self.inflight.get(self.queue_of(group), [])
        waiting = [w for w in q if not w.waited]
        if waiting:
            self.behind(f"blocking {op} on {group.name} group {group.ranks}", waiting)
            for w in q:            # issue order: the blocking op completes after them
                w._complete()

    def host_read(self, category: str) -> None:
        """A counted host read (host_sync): on NCCL it waits for everything the stream waits for."""
        stalls = [f"{what} waits behind {', '.join(w.label for w in works if not w.waited)} still in flight"
                  for what, works in self.pending if any(not w.waited for w in works)]
        if stalls:   # (work the program has waited for since is no stall of this read's: it asked for it)
            self.reports.append(f"host read ({category}): {'; '.join(stalls)}")
        self.pending = []


def _same_view(t: torch.Tensor, base: torch.Tensor, private: torch.Tensor) -> torch.Tensor:
    """The view of `private` (a clone of `base`) that `t` is of `base`."""
    offset = t.storage_offset() - base.storage_offset()
    return private.as_strided(t.shape, t.stride(), private.storage_offset() + offset)
