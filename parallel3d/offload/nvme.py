"""parallel.offload_optimizer=nvme: fp32 master weights and Adam m, v of this rank's shard live in files.

Every bucket's held segment (S elements, buffer.py) has a fixed place in this rank's three files
(master / exp_avg / exp_avg_sq, fp32, buckets one after another). The AdamW step streams the segments
through a fixed pool of host buffers (`parallel.offload_buffer_mb` in all), in chunks of C elements:

    I/O threads:  read k+1, k+2 (read-ahead)  ...  write k-1
    main thread:  grad chunk k (device -> host) -> adamw_flat_ on p, m, v of chunk k
                  -> updated master chunk k -> the device parameter copy (or the shard ZeRO-1/2 all-gather)

so host memory for optimizer state is the pool, whatever the model size; the update is the same
`adamw_flat_` as on the device (bit-identical). Chunks never cross a bucket. Checkpoints read and write
the files row range by row range (state.py through `read_rows` / `write_rows`).
"""
from __future__ import annotations

import concurrent.futures as cf
from typing import Callable, Optional, Sequence

import torch

from parallel3d.data_parallel.adamw import adamw_flat_, clip_ranges, decay_ranges
from parallel3d.data_parallel.buffer import Bucket
from parallel3d.data_parallel.build import fill_segment
from parallel3d.mesh import ParallelContext
from parallel3d.offload.files import OffloadError, StateFiles, create_on_every_rank, host_buffer

KINDS = ("master", "exp_avg", "exp_avg_sq")
SLOTS = 4          # buffers: one computing, one being written back, two read ahead
ELEM = 4           # fp32 bytes


class NvmeAdam:
    """The file-backed home of the buckets' AdamState (`Bucket.adam.home`)."""

    def __init__(self, buckets: Sequence[Bucket], root: str, rank: int, buffer_mb: float, pin: bool) -> None:
        self.base: dict[int, int] = {}      # id(bucket) -> element offset in the files
        total = 0
        for b in buckets:
            self.base[id(b)] = total
            total += b.seg
        self.total = total
        self.files = StateFiles(root, rank, {k: total * ELEM for k in KINDS})
        # each slot: p, m, v (+ a gradient staging chunk when the gradient is on a device)
        parts = len(KINDS) + (1 if pin else 0)
        budget = int(buffer_mb * 2 ** 20)
        self.chunk = max(1024, budget // (SLOTS * parts * ELEM))
        self.slots = [host_buffer(parts * self.chunk, torch.float32, pin) for _ in range(SLOTS)]
        self.pin = pin
        self.io = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="nvme-offload")

    @classmethod
    def create(cls, buckets: Sequence[Bucket], ctx: ParallelContext, root: str, buffer_mb: float) -> "NvmeAdam":
        """The files of this rank, the master initialised from the parameters (every rank agrees on errors)."""
        def build() -> "NvmeAdam":
            home = cls(buckets, root, ctx.rank, buffer_mb, pin=ctx.device.type == "cuda")
            try:
                home.init_from(buckets, fill_segment)
            except OffloadError:
                home.close()
                raise
            return home
        return create_on_every_rank(ctx, build)

    @property
    def buffer_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.slots)

    def close(self) -> None:
        self.io.shutdown(wait=True)
        self.files.close()

    # ---- streaming -----------------------------------------------------------------------------------
    def _tasks(self, buckets: Sequence[Bucket]) -> list[tuple[Bucket, int, int]]:
        return [(b, a, min(a + self.chunk, b.seg)) for b in buckets for a in range(0, b.seg, self.chunk)]

    def _views(self, slot: int, n: int) -> list[torch.Tensor]:
        """[master, exp_avg, exp_avg_sq] (+ gradient staging when pinned) chunk views of one slot."""
        buf = self.slots[slot]
        return [buf[i * self.chunk: i * self.chunk + n] for i in range(buf.numel() // self.chunk)]

    def _io(self, op: str, task, slot: int, kinds: Sequence[str]) -> None:
        b, a, e = task
        views = self._views(slot, e - a)
        for kind in kinds:
            t = views[KINDS.index(kind)]
            off = (self.base[id(b)] + a) * ELEM
            self.files.read(kind, off, t) if op == "read" else self.files.write(kind, off, t)

    def stream(self, buckets: Sequence[Bucket], compute: Callable[[Bucket, int, int, list[torch.Tensor]], None],
               read: Sequence[str] = KINDS, write: Sequence[str] = KINDS) -> None:
        """For every chunk [a, e) of every bucket: read `read` kinds into a slot (ahead, on the I/O threads),
        compute(b, a, e, [master, m, v] views), write the `write` kinds back (behind, on the I/O threads)."""
        tasks = self._tasks(buckets)
        ahead = SLOTS - 2
        reads: dict[int, cf.Future] = {}
        writes: list[Optional[cf.Future]] = [None] * SLOTS

        def submit_read(j: int) -> None:
            slot = j % SLOTS
            if writes[slot] is not None:    # the slot's previous chunk must be on disk before reuse
                writes[slot].result()
                writes[slot] = None
            reads[j] = self.io.submit(self._io, "read", tasks[j], slot, read)

        try:
            for j in range(min(ahead, len(tasks))):
                submit_read(j)
            for i, task in enumerate(tasks):
                if i + ahead < len(tasks):
                    submit_read(i + ahead)
                reads.pop(i).result()
                b, a, e = task
                compute(b, a, e, self._views(i % SLOTS, e - a))
                if write:
                    writes[i % SLOTS] = self.io.submit(self._io, "write", task, i % SLOTS, write)
        finally:
            for f in list(reads.values()) + [w for w in writes if w is not None]:
                f.exception()               # wait for everything in flight (errors: the first one raised)
        for w in writes:
            if w is not None:
                w.result()

    # ---- the optimizer's uses ------------------------------------------------------------------------
    def init_from(self, buckets: Sequence[Bucket], fill: Callable[[Bucket, int, int, torch.Tensor], None]) -> None:
        """Master chunks from fill(b, a, e, out) (the parameters' values); m and v start at zero."""
        def compute(b, a, e, views):
            fill(b, a, e, views[0])
            views[1].zero_()
            views[2].zero_()
        self.stream(buckets, compute, read=())

    def step(self, buckets: Sequence[Bucket], lr: float, betas: tuple[float, float], eps: float,
             weight_decay: float, step: int, publish: Callable[[Bucket, int, int, torch.Tensor], None]) -> None:
        """AdamW over every bucket's state with its reduced gradient shard; publish(b, a, e, master chunk)."""
        decayed = {id(b): decay_ranges(b) for b in buckets}

        def compute(b, a, e, views):
            p, m, v = views[:3]
            g = b.grad.shard[a:e]
            if g.device.type != "cpu":      # stage the device gradient in the slot's pinned part
                g = views[3].copy_(g)
            adamw_flat_(p, m, v, g, clip_ranges(decayed[id(b)], a, e), lr, betas, eps, weight_decay, step)
            publish(b, a, e, p)
        self.stream(buckets, compute)

    def read_master(self, buckets: Sequence[Bucket], publish: Callable[[Bucket, int, int, torch.Tensor], None]) -> None:
        """Stream the master weights only (after a checkpoint load: refresh the parameters)."""
        self.stream(buckets, lambda b, a, e, views: publish(b, a, e, views[0]), read=("master",), write=())

    def read_rows(self, kind: str, b: Bucket, start: int, n: int) -> torch.Tensor:
        """Elements [start, start + n) of bucket b's segment, as a new host tensor (checkpoint save)."""
        return self.files.read(kind, (self.base[id(b)] + start) * ELEM, torch.empty(n, dtype=torch.float32))

    def write_rows(self, kind: str, b: Bucket, start: int, data: torch.Tensor) -> None:
        """Elements [start, start + numel) of bucket b's segment from `data` (checkpoint load)."""
        src = data.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        self.files.write(kind, (self.base[id(b)] + start) * ELEM, src)
