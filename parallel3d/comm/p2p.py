"""Point-to-point sends and receives, posted as one batch (pipeline stages, ring attention)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from parallel3d.comm.collectives import wait_work
from parallel3d.comm.group import Group, _nbytes, _run
from parallel3d.comm.simulated import fill_received
from parallel3d.host_sync import has_values


@dataclass
class P2P:
    """One point-to-point op for `batch_p2p`: op is 'send' or 'recv'; peer is a global rank."""
    op: str
    tensor: torch.Tensor
    peer: int


@dataclass
class PendingP2P:
    """Sends and receives in flight; `wait()` before reading the received buffers (or reusing sent ones)."""
    group: Group
    works: list
    tensors: list  # kept alive until the transfers finish
    # a dry run's SimulatedWork per op, waited with the batch: `works` stays empty there, as a coalesced
    # batch's (the pipeline's P2PQueue then waits it at once and frees sent outputs as NCCL's run does)
    simulated: list = field(default_factory=list)

    def wait(self) -> None:
        for w in self.works:
            wait_work(w, self.group, "batch_p2p wait")
        for w in self.simulated:
            w.wait()
        self.works, self.tensors, self.simulated = [], [], []


def start_batch_p2p(ops: Sequence[P2P], group: Group) -> PendingP2P:
    """Post sends and receives together (batch_isend_irecv) and return at once, so the caller can compute
    while they travel (ring attention overlaps the next K/V block's transfer with this block's math)."""
    if group.simulated:   # a simulated rank with values: no peer writes its receives (comm/simulated.py); filled
        for o in ops:     # before the handles, which (on CUDA) order the device after the fills
            if o.op == "recv" and has_values(o.tensor):
                fill_received(o.tensor, group.pg.generator(o.tensor.device))
    p2p_ops, simulated = [], []
    for i, o in enumerate(ops):
        group._record(o.op, _nbytes(o.tensor), joins_batch=i > 0)
        if group.simulated:
            simulated.append(group.simulated_work())
        else:
            fn = dist.isend if o.op == "send" else dist.irecv
            p2p_ops.append(dist.P2POp(fn, o.tensor, o.peer, group=group.pg))
    works = _run(group, "batch_p2p", lambda: dist.batch_isend_irecv(p2p_ops), *(o.tensor for o in ops)) if ops else []
    return PendingP2P(group, list(works or []), [o.tensor for o in ops], simulated)


def batch_p2p(ops: Sequence[P2P], group: Group) -> None:
    """Issue sends and receives together (batch_isend_irecv) and wait for all of them."""
    start_batch_p2p(ops, group).wait()
