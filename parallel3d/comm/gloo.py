"""Reduce-scatter and all-gather on gloo, built from gloo's faster primitives.

gloo's own reduce-scatter and all-gather are slower than the all-to-all and point-to-point transfers that
move the same bytes (2 ranks on this machine, `benchmarks/gloo_collectives.py`, RESULTS.md "ZeRO-1/2 above
DDP"): from 2 KiB to 32 MiB gloo's reduce-scatter took 1.2-1.8x as long as an all-to-all plus a local sum
(8 MiB: 7.6 against 5.0 ms), and its all-gather 1.1-2.3x as long as direct sends (32 MiB: 32.6 against
14.4 ms). ZeRO-1/2 pay one of each per bucket and step (DDP one all-reduce), sequence parallelism one of
each per layer, so `parallel3d.comm` runs these on every gloo group. NCCL keeps its native collectives; a
dry run standing for gloo (a plan of a CPU run) runs `simulate_reduce_scatter`, the same buffer and sum.

    reduce-scatter, N ranks, input (N*S,) in N segments; rank k keeps segment k of the sum:
        all-to-all: rank k receives every rank's segment k   (N, S)   -- (N-1)/N of the input, as a ring
        wait():     out = sum over the N received segments   (S,)

    all-gather, rank k's input (S,) -> out (N*S,):
        rank k sends its input to every peer and receives peer j's into out[j*S:(j+1)*S]; its own block is
        a local copy (own_block: compute, in a dry run too)          -- (N-1)/N of out, as a ring

The all-gather may run in place (inp is this rank's block of out, as ZeRO-1/2's parameter buffer).
Both return a handle with `wait()` and `is_completed()` (the gradient sync polls the latter on gloo).
Peers are the group's global ranks. The point-to-point tag is this module's own, so a gather in flight
never matches the pipeline's or ring attention's transfers (tag 0); gathers in flight on one group match
in the order they were posted, which every rank shares.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

GATHER_TAG = 0x6A7   # distinct from the tag-0 point-to-point traffic of the pipeline and ring attention


class SumOnWait:
    """An all-to-all reduce-scatter in flight: waiting sums the received segments into `out`."""

    def __init__(self, work, recv: torch.Tensor, out: torch.Tensor, size: int) -> None:
        self.work, self.recv, self.out, self.size = work, recv, out, size

    def is_completed(self) -> bool:
        return self.recv is None or self.work is None or self.work.is_completed()

    def wait(self) -> bool:
        if self.recv is not None:
            if self.work is not None:   # (None: a dry run's, received already)
                self.work.wait()
            torch.sum(self.recv.view(self.size, -1), dim=0, out=self.out)   # (N, S) -> (S,)
            self.recv = None
        return True


class Transfers:
    """Point-to-point sends and receives in flight (an all-gather); keeps its tensors alive until done."""

    def __init__(self, works: list, tensors: list) -> None:
        self.works, self.tensors = works, tensors

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        self.works, self.tensors = [], []
        return True


def start_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, pg: object, size: int) -> SumOnWait:
    """out (S,) <- this rank's segment of the sum over the group of inp (N*S,), both contiguous."""
    recv = torch.empty_like(inp)                                  # (N*S,): every rank's copy of my segment
    work = dist.all_to_all_single(recv, inp, group=pg, async_op=True)
    return SumOnWait(work, recv, out, size)


def simulate_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, size: int, rank: int) -> SumOnWait:
    """A dry run's stand-in (comm.SimulatedProcessGroup of a CPU run): the same receive buffer and sum, as
    if every rank held this rank's data (it receives its own segment k from each of them)."""
    recv = torch.empty_like(inp)                                  # (N*S,)
    mine = inp.view(size, -1)[rank]                               # (S,)
    recv.view(size, -1).copy_(mine.unsqueeze(0).expand(size, -1))
    return SumOnWait(None, recv, out, size)


def start_all_gather(out: torch.Tensor, inp: torch.Tensor, pg: object, ranks: Sequence[int], rank: int
                     ) -> Transfers:
    """out (N*S,) <- every rank's inp (S,), in group-rank order; `rank` is this rank's group rank."""
    blocks = out.view(len(ranks), -1)                               # (N, S)
    ops = []
    for step in range(1, len(ranks)):                               # peers in ring order: no pair waits
        dst, src = (rank + step) % len(ranks), (rank - step) % len(ranks)
        ops.append(dist.P2POp(dist.isend, inp, ranks[dst], group=pg, tag=GATHER_TAG))
        ops.append(dist.P2POp(dist.irecv, blocks[src], ranks[src], group=pg, tag=GATHER_TAG))
    works = dist.batch_isend_irecv(ops)
    own_block(out, inp, len(ranks), rank)
    return Transfers(list(works), [inp, out])


def own_block(out: torch.Tensor, inp: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """This rank's block of an all-gather's out (N*S,), holding inp (S,): a copy on the calling thread,
    which a dry run prices as compute (the transfer's price covers only the peers' blocks), unless inp
    already is that block (in place, as ZeRO-1/2's parameter buffer)."""
    block = out.view(size, -1)[rank]                                # (S,)
    if not torch._C._is_alias_of(inp, out):
        block.copy_(inp.view(-1))
    return block
