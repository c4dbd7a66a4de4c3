"""The backward half of DistributedOptimizer: gradients into buckets, and each bucket's reduction.

A post-accumulate hook adds every gradient into its bucket; a bucket complete on the step's last backward is
launched in its sequence's order (build.py); the reduction is an all-reduce (ZeRO-0), a reduce-scatter
(ZeRO >= 1; on gloo as an all-to-all, reduce.py), a compressed all-reduce (compression.py) or a quantised
all-to-all (qgZ, quantize.py), followed under HSDP by an all-reduce of the segment across the replicas.
`BucketReduction` is a mixin: the optimizer owns the state it uses (buckets, seqs, zero, ctx, ...).
"""
from __future__ import annotations

import torch

from parallel3d import comm
from parallel3d.comm import start_all_reduce, wait_work
from parallel3d.data_parallel.buffer import Bucket, Slot, add_rows
from parallel3d.data_parallel.quantize import quantized_reduce_scatter
from parallel3d.data_parallel.reduce import start_reduce_scatter


class BucketReduction:
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
                    b.grad.full = torch.zeros(b.numel, dtype=self.grad_dtype, device=g.device)
                add_rows(b.grad.full, b.seg, b.nshard, s, g)
            if b.unit is not None:
                self.zero3.on_grad(b.unit)
            if not self._touched:
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._touched.add(b.chunk)
            if self._last[b.chunk]:
                b.grad.count += 1
                if b.grad.count == len(b.slots):
                    b.grad.ready = True
                    self._launch_ready(b.seq)
        return hook

    def _end_of_backward(self) -> None:
        """Runs when the backward pass ends: parameters that got no gradient in it will not get one, so
        launch the rest of the chunk's buckets now (ranks agree on when, unlike bucket readiness), and
        under ZeRO-3 free units that stayed gathered because some parameter had no gradient."""
        touched, self._touched = sorted(self._touched), set()
        for chunk in touched:
            if self.zero3 is not None:
                for unit in self._chains[chunk]:
                    if unit.gathered or unit.pending is not None or unit.fetched:
                        self.zero3.free(unit)
            if self._last[chunk]:
                for seq in self._chunk_seqs.get(chunk, []):
                    for b in self.seqs[seq][self._next[seq]:]:
                        b.grad.ready = True
                    self._launch_ready(seq)

    def _launch_ready(self, seq: int) -> None:
        bs = self.seqs[seq]
        while self._next[seq] < len(bs) and bs[self._next[seq]].grad.ready:
            self._launch(bs[self._next[seq]])
            self._next[seq] += 1

    def _launch(self, b: Bucket) -> None:
        if b.grad.full is None:   # no gradient reached this bucket on this rank (unused parameters)
            b.grad.full = torch.zeros(b.numel, dtype=self.grad_dtype, device=b.slots[0].param.device)
        if self.compressor is not None and self.compressor.active(self.step_count):
            self.compressor.reduce(b)   # synchronous: b.grad.full holds the (approximate) sum
            b.grad.out = b.grad.full[b.shard * b.seg: (b.shard + 1) * b.seg]   # ZeRO-1: the held segment
        elif self.zero == 0:
            b.grad.work = start_all_reduce(b.grad.full, b.group)
        elif self.qgz_block:            # qgZ (synchronous all-to-all of int8 blocks)
            b.grad.out = torch.empty(b.seg, dtype=self.grad_dtype, device=b.grad.full.device)
            quantized_reduce_scatter(b.grad.out, b.grad.full, b.group, self.qgz_block)
        else:
            b.grad.out = torch.empty(b.seg, dtype=self.grad_dtype, device=b.grad.full.device)
            b.grad.work = start_reduce_scatter(b.grad.out, b.grad.full, b.group, self.ctx.backend == "gloo")
        b.grad.launched = True
        self._inflight.append(b)
        while self._inflight and (self._inflight[0].grad.work is None or self._inflight[0].grad.work.is_completed()):
            self._finalize(self._inflight.popleft())   # frees ZeRO-2/3 full buffers early

    def _finalize(self, b: Bucket) -> None:
        if b.grad.replicating:     # HSDP second hop done: the segment is the sum over all of DP
            wait_work(b.grad.work, b.replica, "all_reduce")
            b.grad.replicating = False
        else:
            wait_work(b.grad.work, b.group, "all_reduce" if self.zero == 0 else "reduce_scatter")
            if b.replica is not None and b.replica.size > 1:
                # HSDP: sum the shard group's segment across the replicas (same segment on each), then
                # come back here once that is done; each group's collectives keep bucket order
                b.grad.work, b.grad.replicating = start_all_reduce(b.grad.out, b.replica), True
                self._inflight.append(b)
                return
        b.grad.work = None
        if self.zero == 1:
            seg = b.grad.full[b.shard * b.seg: (b.shard + 1) * b.seg]
            seg.copy_(b.grad.out)
            b.grad.shard = seg
        elif self.zero >= 2:
            b.grad.shard, b.grad.full = b.grad.out, None
        b.grad.out = None
        if self.host_grads is not None:   # offload cpu: the held gradient leaves for the host now
            self.host_grads.start(b)

    def _reduce_extra_groups(self) -> None:
        """meta.grad_reduce groups (partial grads of the same slice, e.g. tp, embedding): one all-reduce each.
        A tied pair held by this one rank (the V placement's embedding and head) is summed here instead."""
        views: dict[str, list[torch.Tensor]] = {}
        changed: dict[int, tuple[Bucket, Slot]] = {}
        for (b, source), (cb, copy) in self._local_ties:
            total = source.flat(b.grad.shard).add_(copy.flat(cb.grad.shard))
            copy.flat(cb.grad.shard).copy_(total)
            changed[id(source)], changed[id(copy)] = (b, source), (cb, copy)
        tied = {id(s) for pair in self._local_ties for _, s in pair}
        for b in self.buckets:
            for s in b.slots:
                for name in s.meta.grad_reduce:
                    if name == "embedding" and id(s) in tied:
                        continue
                    g = getattr(self.ctx, name)  # None: this rank is outside that group (embedding)
                    if g is not None and g.size > 1:
                        views.setdefault(name, []).append(s.flat(b.grad.shard))
                        changed[id(s)] = (b, s)
        for name in sorted(views):
            flat = torch.cat(views[name])
            comm.all_reduce(flat, getattr(self.ctx, name))
            for v, part in zip(views[name], flat.split([v.numel() for v in views[name]])):
                v.copy_(part)
        if self.host_grads is not None:   # those rows left for the host before this sum: send them again
            for b, s in changed.values():
                self.host_grads.refresh(b, s)
