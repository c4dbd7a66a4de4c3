"""Point-to-point groups for the pipeline runtime: post a whole group, wait only for its receives.

``comm.batch_p2p`` waits for every op of a group. On gloo (and on NCCL for large messages) a send
completes only once the peer has posted the matching receive, so waiting for sends makes a rank
sit idle until its neighbour reaches the same point of its own list. The schedule contract
(``schedules.py``, rule 2) allows a runtime to wait only for a group's receives and finish sends
later; ``simulate(..., lazy_sends=True)`` models that. :class:`P2PQueue` does exactly this: the
send handles (and their tensors, which must stay alive) are kept until :meth:`P2PQueue.finish`.

Backends that coalesce a batch into one handle (NCCL) give no per-op handle; there the group is
waited whole, which on NCCL only orders the streams and does not block the host.
Posting and accounting go through ``comm.start_batch_p2p`` (send / recv: bytes of the tensor).
"""
from __future__ import annotations

from typing import Sequence

import torch

from parallel3d import comm
from parallel3d.comm import P2P, Group


class P2PQueue:
    """One rank's pipeline messages on ``group``; ``lazy_sends=False`` waits for sends at once."""

    def __init__(self, group: Group, lazy_sends: bool = True) -> None:
        self.group, self.lazy_sends = group, lazy_sends
        self.pending: list[tuple[object, torch.Tensor]] = []  # (send handle, tensor it reads)

    def exchange(self, ops: Sequence[P2P]) -> None:
        """Post every op of the group together, then wait for the receives (rule 2)."""
        if not ops:
            return
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]  # free buffers
        posted = comm.start_batch_p2p(ops, self.group)
        if not self.lazy_sends or len(posted.works) != len(ops):  # coalesced: one handle for all
            posted.wait()
            return
        for o, w in zip(ops, posted.works):
            if o.op == "send":
                self.pending.append((w, o.tensor))
            else:
                comm.wait_work(w, self.group, f"pipeline recv from rank {o.peer}")

    def finish(self) -> None:
        """Wait for every outstanding send (end of the step)."""
        for w, _ in self.pending:
            comm.wait_work(w, self.group, "pipeline send")
        self.pending.clear()
