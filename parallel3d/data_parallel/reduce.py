"""Bucket collectives with a backend-specific fast path.

gloo's reduce-scatter is much slower than its all-reduce (measured, benchmarks/RESULTS.md: on 2 ranks a
20 MB reduce-scatter takes longer than the all-reduce of the same buffer, which already contains one), so
ZeRO-1/2 lost to DDP there. On gloo the reduce-scatter runs as an all-to-all (rank k receives every rank's
segment k: the same (N-1)/N of the buffer a ring reduce-scatter sends) followed by a local sum of the N
received segments when the handle is waited on. NCCL (and the simulated dry run) use the native one.
Accounting is the reduce-scatter's: the bytes of the full input.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from parallel3d import comm
from parallel3d.comm import Group


class SumOnWait:
    """Work handle of an all-to-all reduce-scatter: waiting sums the received segments into `out`."""

    def __init__(self, work, recv: torch.Tensor, out: torch.Tensor, n: int) -> None:
        self.work, self.recv, self.out, self.n = work, recv, out, n

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> bool:
        if self.recv is not None:
            self.work.wait()
            torch.sum(self.recv.view(self.n, -1), dim=0, out=self.out)   # (N, S) -> (S,)
            self.recv = None
        return True


def start_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group, via_all_to_all: bool) -> Optional[object]:
    """out (S,) <- this rank's segment of the sum over the group of inp (N*S,); a handle for comm.wait_work."""
    if not via_all_to_all or group.size == 1 or group.simulated:
        return comm.start_reduce_scatter(out, inp, group)
    recv = torch.empty_like(inp)                                          # (N*S,): every rank's copy of my segment
    group._record("reduce_scatter", inp.numel() * inp.element_size())
    work = comm._run(group, "reduce_scatter",
                     lambda: dist.all_to_all_single(recv, inp, group=group.pg, async_op=True), out, inp)
    return SumOnWait(work, recv, out, group.size)
