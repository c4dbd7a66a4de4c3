"""The backward half of DistributedOptimizer: gradients into buckets, and each bucket's reduction.

A post-accumulate hook adds every gradient into its bucket's accumulation buffer; a complete bucket is
launched in its sequence's order (build.py); the reduction is an all-reduce (ZeRO-0), a reduce-scatter
(ZeRO >= 1; on gloo as an all-to-all, comm/gloo.py), a compressed all-reduce (compression.py) or a quantised
all-to-all (qgZ, quantize.py), followed under HSDP by an all-reduce of the segment across the replicas.

When buckets are reduced (`per_microbatch`):
    ZeRO-0/1           on the step's last backward only; the full buffer accumulates every microbatch and
                       stays (it is what the rank keeps, or its segment is)
    ZeRO-2/3, offload  in every backward: the buffer of that backward is reduced, the reduced part is
                       added into the rank's persistent gradient (the device shard; under optimizer
                       offload the host copy, offload/host_grads.py) and the buffer is freed. The device
                       then holds the shard plus the buckets in flight, whatever the number of microbatches
                       (DeepSpeed's stage 2 reduces at every micro-step boundary the same way).

Follow-ups of a finished reduction (`_follow_up`: the HSDP replica all-reduce, accumulating into the held
gradient, freeing the buffer, the offload copy): on a backend whose work orders the device (NCCL,
comm.orders_on_device) they are queued right after the collective, on a side stream that waits for its
work handle, so neither the host nor the compute stream waits. Every reduction hands back a handle, the
ones this rank computes itself too (a size-1 group, compression, qgZ: comm.local_work), and waiting it is
what orders the side stream after the stream that wrote the output (comm/strict.py owns the rule); elsewhere (gloo) each launch polls the oldest
reductions with is_completed() and follows up the finished ones, and finish_grad_sync waits for the rest.

`GradientSync` owns this: the buckets' gradient state (`b.grad`), the hooks, the launch order, the
reductions in flight, compression (its Compressor) and the meta.grad_reduce sums. It receives what it
works with: the launch sequences (build.py, or ZeRO-3's unit buckets), the compressor, the offload home of
the held gradients, ZeRO-3's gatherer (to free a unit once its gradients are in).
"""
from __future__ import annotations

import collections
import contextlib
from dataclasses import dataclass
from typing import Any, Optional

import torch

from parallel3d import comm
from parallel3d.comm import start_all_reduce, start_reduce_scatter, wait_work
from parallel3d.data_parallel.buffer import Bucket, Slot, add_rows
from parallel3d.data_parallel.build import local_ties
from parallel3d.data_parallel.compression import Compressor
from parallel3d.data_parallel.quantize import quantized_reduce_scatter
from parallel3d.data_parallel.zero3 import Zero3
from parallel3d.mesh import ParallelContext


def grad_buffer(numel: int, dtype: torch.dtype, device: torch.device, zero: bool = False) -> torch.Tensor:
    """Every gradient buffer the reduction allocates (accumulation buffers, reduced segments): one place,
    which the planner's tracker recognises to label them gradients wherever they are freed."""
    return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)


@dataclass
class Pending:
    """One bucket reduction in flight: `full`, the accumulation buffer it reads (kept alive until the
    follow-up), `out`, what the rank keeps (its reduced segment; ZeRO-0: the whole buffer)."""
    b: Bucket
    full: torch.Tensor
    out: torch.Tensor
    work: object = None
    replicating: bool = False   # HSDP: `out` is being summed across the replicas


class FollowUps:
    """Where a finished reduction's follow-ups run: `ordered` (module docstring) right after the launch,
    under `context()` (CUDA: a side stream, so compute does not wait for the collective); the consumers of
    the held gradients `join()` that stream first."""

    def __init__(self, ordered: bool, device: torch.device) -> None:
        self.ordered, self.device = ordered, device
        self.stream = torch.cuda.Stream(device) if ordered and device.type == "cuda" else None

    def context(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def keep(self, *tensors: Optional[torch.Tensor]) -> None:
        """Tensors the side stream reads: the allocator must not hand them out before it is done."""
        if self.stream is not None:
            for t in tensors:
                if t is not None:
                    t.record_stream(self.stream)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class GradientSync:
    """Gradients into buckets and each bucket's reduction (module docstring). seqs: the launch sequences
    (build.py); chunks: how many model chunks; per_microbatch: reduce in every backward (ZeRO-2/3,
    offload); qgz_block > 0: ZeRO-3's reduce-scatter as int8 blocks; host_grads: the held gradients'
    offload home (offload/host_grads.py) or None."""

    def __init__(self, seqs: list[list[Bucket]], chunks: int, ctx: ParallelContext, zero: int,
                 grad_dtype: torch.dtype, per_microbatch: bool, compressor: Optional[Compressor] = None,
                 qgz_block: int = 0, host_grads: Any = None, zero3: Optional[Zero3] = None) -> None:
        self.seqs, self.buckets = seqs, [b for bs in seqs for b in bs]
        self.params = [s.param for b in self.buckets for s in b.slots]
        self.ctx, self.zero, self.grad_dtype, self.per_microbatch = ctx, zero, grad_dtype, per_microbatch
        self.compressor, self.qgz_block, self.host_grads, self.zero3 = compressor, qgz_block, host_grads, zero3
        self.step_count = 0                  # the optimizer step these gradients are for (zero_grad sets it)
        self._inflight: collections.deque[Pending] = collections.deque()
        self._next = [0] * len(seqs)         # per sequence: the next bucket to launch
        self.follow = FollowUps(any(comm.orders_on_device(b.group) for b in self.buckets), ctx.device)
        self._last = [True] * chunks         # per chunk: is the running backward the step's last one?
        self._chunk_seqs: dict[int, list[int]] = {}
        for i, bs in enumerate(seqs):
            self._chunk_seqs.setdefault(bs[0].chunk, []).append(i)
        self._touched: set[int] = set()      # chunks whose gradients arrived during the running backward
        self.hooks = [s.param.register_post_accumulate_grad_hook(self._grad_hook(b, s))
                      for b in self.buckets for s in b.slots]
        self._local_ties = local_ties(self.buckets)

    def zero_grad(self, step_count: int) -> None:
        """Start the gradients of optimizer step `step_count` (compression starts at its start step)."""
        self._follow_ups(block=True)      # reductions a step never waited for (an abandoned step)
        self.follow.join()
        if self.host_grads is not None:   # copies of a skipped step may still read the buffers zeroed here
            self.host_grads.reset(self.buckets)
        for b in self.buckets:
            b.grad.count, b.grad.ready, b.grad.launched, b.grad.work, b.grad.out = 0, False, False, None, None
            b.grad.replicating = False
            if not self.per_microbatch:
                b.grad.full.zero_()
                b.grad.shard = b.grad.full if self.zero == 0 else None
            else:
                b.grad.full = b.grad.shard = None
        for p in self.params:
            p.grad = None
        self._touched.clear()
        self._next = [0] * len(self.seqs)
        self.step_count = step_count

    def set_last_microbatch(self, last: bool, chunk: Optional[int] = None) -> None:
        for i in range(len(self._last)) if chunk is None else [chunk]:
            self._last[i] = bool(last)

    def finish(self) -> None:
        """Launch what never became ready (unused parameters), wait for every reduction, then the
        meta.grad_reduce sums: the held gradients are final."""
        for seq, bs in enumerate(self.seqs):
            for b in bs[self._next[seq]:]:
                b.grad.ready = True
            self._launch_ready(seq)
        self._drain_reductions()
        self._reduce_extra_groups()

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    # ---- backward ----------------------------------------------------------------------------------
    def _grad_hook(self, b: Bucket, s: Slot):
        def hook(p: torch.Tensor) -> None:
            g, p.grad = p.grad, None
            if g is None:
                return
            if b.grad.launched:
                raise RuntimeError(f"gradient of {s.name} arrived after its bucket was reduced: call "
                                   f"set_last_microbatch(False) before every microbatch but the last")
            with torch.no_grad():
                if b.grad.full is None:
                    b.grad.full = grad_buffer(b.numel, self.grad_dtype, g.device, zero=True)
                add_rows(b.grad.full, b.seg, b.nshard, s, g)
            if b.unit is not None:
                self.zero3.on_grad(b.unit)
            if not self._touched:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._touched.add(b.chunk)
            if self.per_microbatch or self._last[b.chunk]:
                b.grad.count += 1
                if b.grad.count == len(b.slots):
                    b.grad.ready = True
                    self._launch_ready(b.seq)
        return hook

    def _end_of_backward(self) -> None:
        """Runs when the backward pass ends: parameters that got no gradient in it will not get one, so
        launch the rest of the chunk's buckets now (ranks agree on when, unlike bucket readiness), and
        under ZeRO-3 free units that stayed gathered because some parameter had no gradient. Reducing per
        microbatch, the chunk's buckets then start over for its next backward."""
        touched, self._touched = sorted(self._touched), set()
        for chunk in touched:
            if self.zero3 is not None:
                self.zero3.free_chunk(chunk)
            if self._last[chunk] or self.per_microbatch:
                for seq in self._chunk_seqs.get(chunk, []):
                    for b in self.seqs[seq][self._next[seq]:]:
                        b.grad.ready = True
                    self._launch_ready(seq)
                    if not self._last[chunk]:   # the step's last backward keeps them launched (a late
                        self._next[seq] = 0     # gradient is an error, finish_grad_sync launches no more)
                        for b in self.seqs[seq]:
                            b.grad.count, b.grad.ready, b.grad.launched = 0, False, False

    def _launch_ready(self, seq: int) -> None:
        bs = self.seqs[seq]
        while self._next[seq] < len(bs) and bs[self._next[seq]].grad.ready:
            self._launch(bs[self._next[seq]])
            self._next[seq] += 1

    def _launch(self, b: Bucket) -> None:
        full = b.grad.full
        if full is None:   # no gradient reached this bucket on this rank (unused parameters)
            full = b.grad.full = grad_buffer(b.numel, self.grad_dtype, b.slots[0].param.device, zero=True)
        p = Pending(b, full, full)
        if self.compressor is not None and self.compressor.active(self.step_count):
            p.out = full[b.shard * b.seg: (b.shard + 1) * b.seg] if self.zero else full   # the held segment
            # blocking: b.grad.full holds the (approximate) sum; its handle orders the follow-ups after it
            p.work = comm.local_work(b.group, "compressed_all_reduce", [p.out], lambda: self.compressor.reduce(b))
        elif self.zero == 0:
            p.work = start_all_reduce(full, b.group)
        elif self.qgz_block:            # qgZ (a blocking all-to-all of int8 blocks), handed back as a handle
            p.out = grad_buffer(b.seg, self.grad_dtype, full.device)
            p.work = comm.local_work(b.group, "reduce_scatter", [p.out],
                                     lambda: quantized_reduce_scatter(p.out, full, b.group, self.qgz_block))
        else:
            p.out = grad_buffer(b.seg, self.grad_dtype, full.device)
            p.work = start_reduce_scatter(p.out, full, b.group)
        if self.per_microbatch:
            b.grad.full = None   # the next backward accumulates into a fresh buffer
        b.grad.launched = True
        self._inflight.append(p)
        self._follow_ups(block=False)

    def _follow_ups(self, block: bool) -> None:
        """Follow up the reductions in flight, oldest first: all of them when the backend orders them on
        the device (or `block`), else those the host sees completed (they stay in bucket order)."""
        with self.follow.context():
            while self._inflight:
                head = self._inflight[0]
                if not (block or self.follow.ordered or head.work.is_completed()):
                    return
                self._follow_up(self._inflight.popleft())

    def _follow_up(self, p: Pending) -> None:
        b = p.b
        if p.replicating:     # HSDP second hop done: the segment is the sum over all of DP
            wait_work(p.work, b.replica, "all_reduce")
            p.replicating = False
        else:
            wait_work(p.work, b.group, "all_reduce" if self.zero == 0 else "reduce_scatter")
            if b.replica is not None and b.replica.size > 1:
                # HSDP: sum the shard group's segment across the replicas (same segment on each), then
                # come back here once that is done; each group's collectives keep bucket order
                p.work, p.replicating = start_all_reduce(p.out, b.replica), True
                self._inflight.append(p)
                return
        p.work = None
        self.follow.keep(p.full, p.out)
        if self.host_grads is not None:   # offload: the held gradient leaves for the host, added there
            self.host_grads.start(b, p.out)
        elif self.zero == 0:
            b.grad.shard = p.full
        elif self.zero == 1 and not self.per_microbatch:   # the segment lives inside the full buffer
            seg = p.full[b.shard * b.seg: (b.shard + 1) * b.seg]
            seg.copy_(p.out)
            b.grad.shard = seg
        elif b.grad.shard is None:        # the step's first reduction of this bucket
            b.grad.shard = p.out
        else:                             # later microbatches add into the held shard
            b.grad.shard.add_(p.out)

    def _drain_reductions(self) -> None:
        """Every reduction in flight followed up, and its results visible to the current stream."""
        self._follow_ups(block=True)
        self.follow.join()
        if self.host_grads is not None:   # the host copies are the held gradients from here on
            self.host_grads.finish(self.buckets)

    def _reduce_extra_groups(self) -> None:
        """meta.grad_reduce groups (partial grads of the same slice, e.g. tp, embedding): one all-reduce each.
        A tied pair held by this one rank (the V placement's embedding and head) is summed here instead.
        Under optimizer offload the held gradients are host tensors: the sum travels through the device."""
        views: dict[str, list[torch.Tensor]] = {}
        for (b, source), (cb, copy) in self._local_ties:
            total = source.flat(b.grad.shard).add_(copy.flat(cb.grad.shard))
            copy.flat(cb.grad.shard).copy_(total)
        tied = {id(s) for pair in self._local_ties for _, s in pair}
        for b in self.buckets:
            for s in b.slots:
                for name in s.meta.grad_reduce:
                    if name == "embedding" and id(s) in tied:
                        continue
                    g = getattr(self.ctx, name)  # None: this rank is outside that group (embedding)
                    if g is not None and g.size > 1:
                        views.setdefault(name, []).append(s.flat(b.grad.shard))
        for name in sorted(views):
            flat = torch.cat(views[name]).to(self.ctx.device)
            comm.all_reduce(flat, getattr(self.ctx, name))
            for v, part in zip(views[name], flat.split([v.numel() for v in views[name]])):
                v.copy_(part)
