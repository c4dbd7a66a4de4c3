"""The parameter half of DistributedOptimizer: updated master weights back into the model parameters.

    zero  where the updated master goes                         then
    0     the flat parameter buffer (params are views of it)    -
    1/2   this rank's segment of the bucket's flat parameter    all-gathered in place: every rank's segment
          buffer (params are views of it)                       lands in the parameters, no copy
    3     the persistent shard (or the parameter offload home)  gathered around each unit's use (zero3.py)

With optimizer or parameter offload the device copies are asynchronous (offload/publish.py): each bucket's
copy is issued right after its update and its first reader waits for that bucket only.

`ParamPublisher` owns this: the buckets whose segment is published, the overlapped gathers in flight, the
forward hooks that wait for a bucket's parameters, and where ZeRO-3 fetches its persistent shard from
under offload. The optimizer step calls `updated(b)` after each bucket's AdamW and `step_done()` after
the last; it receives the buckets, the offload homes (offload/homes.py) and ZeRO-3's gatherer.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from parallel3d.comm import start_all_gather, wait_work
from parallel3d.data_parallel.buffer import Bucket
from parallel3d.data_parallel.zero3 import Zero3
from parallel3d.offload.homes import OffloadHomes


class ParamPublisher:
    def __init__(self, buckets: Sequence[Bucket], modules: Sequence[nn.Module], zero: int, dtype: torch.dtype,
                 homes: OffloadHomes, zero3: Optional[Zero3] = None, overlap: bool = False,
                 gather_groups: Optional[dict] = None) -> None:
        """overlap (ZeRO-1/2, `overlap_param_gather`): step() leaves each bucket's all-gather in flight and
        the first forward use of the bucket waits for it (a forward pre-hook on the modules owning its
        parameters), so the gathers travel beside the next forward, as Megatron's overlap_param_gather.
        Each gather lands in its bucket's parameter buffer, so none needs memory of its own. The optimizer
        step updates the buckets in forward order (step.py), so the gathers are issued in the order the
        forward waits for them. gather_groups: {expert: Group}, the clones of the shard groups the gathers
        run on (their own queue: nothing the next step issues on DP x CP waits behind them); None: b.group."""
        self.buckets, self.zero, self.dtype, self.zero3 = list(buckets), zero, dtype, zero3
        self.gather_groups = gather_groups
        self.published, self.param_home, self.nvme = homes.published, homes.param_home, homes.nvme
        self._staged: set[int] = set()                # ZeRO-1/2: buckets whose segment holds this step's master
        self._gathers: dict[int, tuple] = {}          # overlap: id(bucket) -> (bucket, work)
        self._pending: list[tuple] = []               # ZeRO-1/2 gathers of the running step
        self.overlap_param_gather = overlap and zero in (1, 2)
        self.hooks: list = []
        if zero3 is not None and self.param_home is not None:
            zero3.fetch = self.param_home.fetch
        elif zero3 is not None and self.published is not None:  # the shard may still be on its way from the step
            zero3.fetch = self._published_shard
        if zero == 0 and self.published is not None:   # a module's forward waits for its own buckets only
            self.hooks += self.published.hooks(self.buckets, modules)
        if self.overlap_param_gather:
            from parallel3d.offload.publish import bucket_hooks
            self.hooks += bucket_hooks(self.buckets, modules, self._wait_gather)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    def updated(self, b: Bucket) -> None:
        """b's AdamW is done: start publishing it (ZeRO-1/2: its all-gather travels while the next buckets
        update, and with overlap beside the next forward, which waits for it; offload: its device copy)."""
        if self.zero in (1, 2):
            started = self._start_publish(b)
            if self.overlap_param_gather:
                self._gathers[id(b)] = started
            else:
                self._pending.append(started)
        elif self.published is not None and b.param_flat is not b.adam.master:
            self.publish_chunk(b, 0, b.seg, b.adam.master)   # its copy travels while the next update

    def step_done(self) -> None:
        """Every bucket updated: the parameters are published (or on their way, waited by their readers)."""
        if self.zero in (1, 2):
            pending, self._pending = self._pending, []
            self._finish_publish(pending)
        elif self.published is None:
            self.publish_params()
        elif self.zero3 is not None:
            self.zero3.invalidate()

    def _wait_gather(self, b: Bucket) -> None:
        g = self._gathers.pop(id(b), None)
        if g is not None:
            self._finish_publish([g])

    def wait_params(self) -> None:
        """Every parameter up to date (overlap_param_gather: the gathers no forward has waited for yet).
        Call before reading parameters outside the model's forward (checkpoints, tests)."""
        pending, self._gathers = list(self._gathers.values()), {}
        self._finish_publish(pending)

    @torch.no_grad()
    def publish_chunk(self, b: Bucket, a: int, e: int, values: torch.Tensor,
                      staging: Optional[torch.Tensor] = None):
        """Elements [a, e) of b's updated master -> the parameters' home: the ZeRO-0/3 flat copy, the
        parameter offload home, or (ZeRO-1/2) this rank's segment of the parameter buffer, which the
        all-gather then sends to every rank. With offload
        the device copy is asynchronous: returns its ticket (`staging`: a pinned buffer for the
        conversion to the compute dtype, kept by the caller until then)."""
        if self.param_home is not None:
            self.param_home.store(b, a, e, values)
            return None
        if self.zero in (0, 3):
            dst = b.param_flat[a:e]
        else:  # the all-gather runs on the device (master may be on the host)
            self._wait_gather(b)   # overlap: last step's gather of b, if no forward waited for it, still sends
            self._staged.add(id(b))
            dst = self._segment(b)[a:e]
        if self.published is None:
            dst.copy_(values)
            return None
        return self.published.copy(b, dst, values, staging)

    def _published_shard(self, b: Bucket):
        """ZeRO-3 with an offloaded optimizer: b's persistent shard with the step's copies into it still to
        wait for (the gather waits when it starts, not the read-ahead: on CUDA a wait orders the stream)."""
        from parallel3d.offload.streams import Fetched
        return Fetched(b.param_flat, self.published.take(b))

    @torch.no_grad()
    def publish_params(self, streamed: bool = False) -> None:
        """Copy the fp32 master weights into the model parameters (all-gathered for ZeRO-1/2).
        streamed: the NVMe step already passed every chunk to publish_chunk."""
        if self.zero3 is not None:
            self.zero3.invalidate()   # hpZ's secondary copies are stale
        if self.zero in (1, 2):
            self.wait_params()   # an overlapped gather of the last step still sends from the segment
        if self.nvme is not None and not streamed:
            self.nvme.read_master(self.buckets, self.publish_chunk)
        for b in self.buckets if self.nvme is None else []:
            if self.zero in (1, 2) or b.param_flat is not b.adam.master:
                self.publish_chunk(b, 0, b.seg, b.adam.master)
        if self.zero in (0, 3):
            return
        self._finish_publish([self._start_publish(b) for b in self.buckets])

    @staticmethod
    def _segment(b: Bucket) -> torch.Tensor:
        """ZeRO-1/2: this rank's segment of the bucket's parameter buffer, (S,)."""
        return b.param_flat[b.shard * b.seg: (b.shard + 1) * b.seg]

    def _start_publish(self, b: Bucket) -> tuple:
        """ZeRO-1/2: the updated master into this rank's segment of the parameter buffer, then the
        all-gather of the buffer in place (`updated` calls it right after the bucket's AdamW, so the gather
        travels while the next buckets update)."""
        if id(b) not in self._staged:   # (NVMe streams its chunks in through publish_chunk first)
            self.publish_chunk(b, 0, b.seg, b.adam.master)
        self._staged.discard(id(b))
        if self.published is not None:   # offload: the segment's copy from the host, in flight
            self.published.wait(b)
        group = self._gather_group(b)
        return b, start_all_gather(b.param_flat, self._segment(b), group)

    def _gather_group(self, b: Bucket):
        return b.group if self.gather_groups is None else self.gather_groups[b.expert]

    def _finish_publish(self, pending: list[tuple]) -> None:
        for b, work in pending:
            wait_work(work, self._gather_group(b), "all_gather")
