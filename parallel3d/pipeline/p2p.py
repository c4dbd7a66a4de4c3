"""Point-to-point messages of the pipeline runtime: post a group at once, wait for a receive only where
its tensor is needed, finish sends in the background.

``comm.batch_p2p`` waits for every op of a group. On gloo (and on NCCL for large messages) a send
completes only once the peer has posted the matching receive, so waiting for sends makes a rank
sit idle until its neighbour reaches the same point of its own list. The schedule contract
(``schedules.py``, rule 2) allows a runtime to wait only for a group's receives and finish sends
later; ``simulate(..., lazy_sends=True)`` models that. :class:`P2PQueue` does this: the send
handles (and their tensors, which must stay alive) are kept until they complete, at the latest
:meth:`P2PQueue.finish`.

Receives go further where the backend completes every op on its own (gloo: one handle per op,
matched per peer in posting order, progressed by its own threads): the runtime posts them one
group early (``runtime_schedules.rank_plan``) and :class:`Incoming` is waited by the compute that
reads it. Posting a receive earlier and waiting for it later can only let every rank get further
than the verified model, and receives keep their order per peer, so the pairing is unchanged.
Backends that coalesce a batch into one handle (NCCL) run each group as scheduled and wait it whole:
there one stream per peer pair orders the ops, and a receive queued ahead of a send the peer needs
first would deadlock; the wait only orders the streams and does not block the host.
Posting and accounting go through ``comm.start_batch_p2p`` (send / recv: bytes of the tensor).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from parallel3d import comm
from parallel3d.comm import P2P, Group


def completes_per_op(group: Group) -> bool:
    """True where each posted op completes by itself with its own handle (gloo), so receives may be
    posted early and waited late. Not on the strict test backend (comm/strict.py), which runs NCCL's path."""
    return (group.pg is not None and not group.simulated and group.strict is None
            and dist.get_backend(group.pg) == "gloo")


@dataclass
class Incoming:
    """A posted receive: ``buf`` holds the tensor once ``work`` is waited."""
    work: object
    buf: torch.Tensor
    peer: int
    label: object = None  # the runtime's RECV action, for its record


class P2PQueue:
    """One rank's pipeline messages on ``group``; ``lazy_sends=False`` waits for sends at once.
    ``early``: receives are returned unwaited (:class:`Incoming`) for the consumer to wait."""

    def __init__(self, group: Group, lazy_sends: bool = True) -> None:
        self.group, self.lazy_sends = group, lazy_sends
        self.early = lazy_sends and completes_per_op(group)
        self.pending: list[tuple[object, torch.Tensor]] = []  # (send handle, tensor it reads)

    def post(self, ops: Sequence[P2P]) -> list[Incoming] | None:
        """Post every op together. Returns the receives (in order) to wait later, or None when they
        have already been waited (coalesced backends, strict mode, no early receives)."""
        if self.pending:
            self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]  # free sent outputs
        posted = comm.start_batch_p2p(ops, self.group)
        if not self.lazy_sends or len(posted.works) != len(ops):  # coalesced: one handle for all
            posted.wait()
            return None
        incoming = []
        for o, w in zip(ops, posted.works):
            if o.op == "send":
                self.pending.append((w, o.tensor))
            else:
                incoming.append(Incoming(w, o.tensor, o.peer))
        if self.early:
            return incoming
        for inc in incoming:
            self.wait(inc)
        return None

    def wait(self, inc: Incoming) -> torch.Tensor:
        if inc.work is not None:   # (a second read of the same receive)
            comm.wait_work(inc.work, self.group, f"pipeline recv from rank {inc.peer}")
        inc.work = None
        return inc.buf

    def finish(self) -> None:
        """Wait for every outstanding send (end of the step)."""
        for w, _ in self.pending:
            comm.wait_work(w, self.group, "pipeline send")
        self.pending.clear()
