"""Where the tensors between stages wait on one pipeline rank: outputs and input gradients until their
SEND, received inputs and output gradients until the compute that reads them.

Mailboxes are keyed by (microbatch, local chunk). An inbox entry is a tensor, or a receive still in
flight (``p2p.Incoming``) that :meth:`Mailboxes.take` waits for: with early receives (``p2p.py``) a
rank blocks only when, and for exactly as long as, a compute needs what has not arrived yet.
Messages carry no tags: between two ranks they pair in list order (rule 3 of ``schedules.py``), so
each receive buffer is simply allocated with the known shape of the residual stream between stages.
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import torch
from torch import nn

from parallel3d.comm import P2P
from parallel3d.mesh import ParallelContext

from .actions import Action, ActionKind
from .p2p import Incoming, P2PQueue
from .placement import locate, stage_of

K = ActionKind


class Mailboxes:
    """One rank's messages. ``record`` gets ``(pp rank, RECV action, start, end)`` for every receive
    waited by a compute; :attr:`resumed` is when the last such wait ended (the compute's start)."""

    def __init__(self, ctx: ParallelContext, chunks: Sequence[nn.Module], mbs: Sequence[dict],
                 placement: str, lazy_sends: bool, record: list | None, trace: list | None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.ctx, self.chunks, self.mbs, self.record, self.trace, self.clock = ctx, chunks, mbs, record, trace, clock
        p, v, self.rank = ctx.spec.pp, len(chunks), ctx.coords.pp
        last = p * v - 1
        stages = [stage_of(self.rank, c, p, placement) for c in range(v)]
        # where chunk c's output (its input gradient) goes: (pp rank, chunk there), None past the ends
        self.next = [locate(s + 1, p, placement) if s < last else None for s in stages]
        self.prev = [locate(s - 1, p, placement) if s > 0 else None for s in stages]
        self.dtypes = [next((q.dtype for q in c.parameters()), torch.float32) for c in chunks]
        self.shapes: dict[tuple[int, int, int], tuple[int, ...]] = {}
        self.inbox_act: dict[tuple[int, int], torch.Tensor | Incoming] = {}   # inputs for F
        self.inbox_grad: dict[tuple[int, int], torch.Tensor | Incoming] = {}  # output grads for B/I
        self.outbox_act: dict[tuple[int, int], torch.Tensor] = {}   # outputs waiting for SEND_ACT
        self.outbox_grad: dict[tuple[int, int], torch.Tensor] = {}  # input grads for SEND_GRAD
        self.queue = P2PQueue(ctx.pp, lazy_sends)
        self.peers = ctx.pp.ranks
        self.messages = 0
        self.resumed = 0.0

    def shape(self, mb: int, chunk: int) -> tuple[int, ...]:
        """Shape of the residual stream between stages: (b, s_local[/tp], h); dtype: ``self.dtypes``."""
        b, s = self.mbs[mb]["ids"].shape[:2]
        key = (chunk, b, s)
        if key not in self.shapes:
            self.shapes[key] = tuple(self.chunks[chunk].boundary_shape(b, s))
        return self.shapes[key]

    def communicate(self, acts: Sequence[Action]) -> bool:
        """Post ``acts`` at once; True when their receives were waited here too (``p2p.py``)."""
        ops, recvs = [], []
        for a in acts:
            key, peer = (a.microbatch, a.chunk), self.peers[a.peer]
            if a.kind is K.SEND_ACT:
                ops.append(P2P("send", self.outbox_act.pop(key), peer))
            elif a.kind is K.SEND_GRAD:
                ops.append(P2P("send", self.outbox_grad.pop(key), peer))
            else:
                buf = torch.empty(self.shape(*key), dtype=self.dtypes[a.chunk], device=self.ctx.device)
                ops.append(P2P("recv", buf, peer))
                recvs.append((a, buf))
        if self.trace is not None:
            self.trace += [("post", a) for a in acts]
        incoming = self.queue.post(ops)
        self.messages += len(ops)
        for i, (a, buf) in enumerate(recvs):
            box = self.inbox_act if a.kind is K.RECV_ACT else self.inbox_grad
            if incoming is not None:
                incoming[i].label = a
            box[(a.microbatch, a.chunk)] = buf if incoming is None else incoming[i]
        return incoming is None

    def take(self, box: dict, key: tuple[int, int]) -> torch.Tensor:
        """The tensor in ``box`` under ``key``, waiting here for it if it is still travelling."""
        got = box.pop(key)
        if type(got) is not Incoming:
            return got
        if self.trace is not None:
            self.trace.append(("wait", got.label))
        if self.record is None:
            return self.queue.wait(got)
        start = self.clock()
        self.queue.wait(got)
        self.resumed = self.clock()
        self.record.append((self.rank, got.label, start, self.resumed))
        return got.buf

    def hand_over(self, tensor: torch.Tensor, mb: int, chunk: int, forward: bool) -> None:
        """Queue an output (input grad) for the next (previous) stage: for its SEND action, or
        straight into this rank's own inbox when that stage is local (p == 1, or the turn of a V)."""
        rank, local_chunk = (self.next if forward else self.prev)[chunk]
        if rank != self.rank:
            (self.outbox_act if forward else self.outbox_grad)[(mb, chunk)] = tensor
        else:
            (self.inbox_act if forward else self.inbox_grad)[(mb, local_chunk)] = tensor

    def finish(self) -> list[str]:
        """Wait for the last sends; names what the schedule left unconsumed (should be nothing)."""
        self.queue.finish()
        return [name for name, box in (("activations to send", self.outbox_act),
                                       ("gradients to send", self.outbox_grad),
                                       ("received activations", self.inbox_act),
                                       ("received gradients", self.inbox_grad)) if box]
