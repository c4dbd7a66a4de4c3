"""Point-to-point groups for the pipeline runtime: post a whole group, wait only for its receives.

``comm.batch_p2p`` waits for every op of a group. On gloo (and on NCCL for large messages) a send
completes only once the peer has posted the matching receive, so waiting for sends makes a rank
sit idle until its neighbour reaches the same point of its own list. The schedule contract
(``schedules.py``, rule 2) allows a runtime to wait only for a group's receives and finish sends
later; ``simulate(..., lazy_sends=True)`` models that. :class:`P2PQueue` does exactly this: the
send handles (and their tensors, which must stay alive) are kept until :meth:`P2PQueue.finish`.

Backends that coalesce a batch into one handle (NCCL) give no per-op handle; there the group is
waited whole, which on NCCL only orders the streams and does not block the host.
Bytes are accounted like ``comm`` does (send / recv: bytes of the tensor).
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from parallel3d.comm import P2P, CollectiveError, Group


class P2PQueue:
    """One rank's pipeline messages on ``group``; ``lazy_sends=False`` waits for sends at once."""

    def __init__(self, group: Group, lazy_sends: bool = True) -> None:
        self.group, self.lazy_sends = group, lazy_sends
        self.pending: list[tuple[object, torch.Tensor]] = []  # (send handle, tensor it reads)

    def _wait(self, work: object, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise CollectiveError(f"pipeline {what} on {self.group.name} group (ranks "
                                  f"{self.group.ranks}) failed on rank {self.group.global_rank}: "
                                  f"{e}") from e

    def exchange(self, ops: Sequence[P2P]) -> None:
        """Post every op of the group together, then wait for the receives (rule 2)."""
        if not ops:
            return
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]  # free buffers
        p2p_ops = []
        for o in ops:
            self.group._record(o.op, o.tensor.numel() * o.tensor.element_size())
            fn = dist.isend if o.op == "send" else dist.irecv
            p2p_ops.append(dist.P2POp(fn, o.tensor, o.peer, group=self.group.pg))
        try:
            works = dist.batch_isend_irecv(p2p_ops)
        except RuntimeError as e:
            raise CollectiveError(f"pipeline batch_isend_irecv on {self.group.name} group failed "
                                  f"on rank {self.group.global_rank}: {e}") from e
        if not self.lazy_sends or len(works) != len(ops):  # coalesced: one handle for all
            for w in works:
                self._wait(w, "p2p")
            return
        for o, w in zip(ops, works):
            if o.op == "send":
                self.pending.append((w, o.tensor))
            else:
                self._wait(w, f"recv from rank {o.peer}")

    def finish(self) -> None:
        """Wait for every outstanding send (end of the step)."""
        for w, _ in self.pending:
            self._wait(w, "send")
        self.pending.clear()
