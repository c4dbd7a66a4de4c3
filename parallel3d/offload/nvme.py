"""parallel.offload_optimizer=nvme: fp32 master weights and Adam m, v of this rank's shard live in files.

Every bucket's held segment (S elements, buffer.py) has a fixed place in this rank's three files
(master / exp_avg / exp_avg_sq, fp32, buckets one after another). The AdamW step streams the segments
through a fixed pool of host buffers (`parallel.offload_buffer_mb` in all), in chunks of C elements:

    I/O threads:  read k+1, k+2 (read-ahead)  ...  write k-1
    copy engine:  grad chunks k+1, k+2 device -> host (issued with their reads)  ...  master k-1 -> device
    main thread:  adamw_flat_ on p, m, v, g of chunk k -> issue chunk k's copy to the device parameters
                  (or the shard ZeRO-1/2 all-gathers), converted to the compute dtype in the slot's
                  gradient part; a slot is reused once its write-back and its copy are done

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
from parallel3d.offload.streams import CopyEngine, Ticket

KINDS = ("master", "exp_avg", "exp_avg_sq")
SLOTS = 4          # buffers: one computing, one being written back, two read ahead
ELEM = 4           # fp32 bytes


class NvmeAdam:
    """The file-backed home of the buckets' AdamState (`Bucket.adam.home`)."""

    def __init__(self, buckets: Sequence[Bucket], root: str, rank: int, buffer_mb: float, pin: bool,
                 engine: Optional[CopyEngine] = None) -> None:
        self.base: dict[int, int] = {}      # id(bucket) -> element offset in the files
        total = 0
        for b in buckets:
            self.base[id(b)] = total
            total += b.seg
        self.total = total
        self.files = StateFiles(root, rank, {k: total * ELEM for k in KINDS})
        # each slot: p, m, v and a staging part (the gradient chunk, then the converted parameter chunk)
        parts = len(KINDS) + 1
        budget = int(buffer_mb * 2 ** 20)
        self.chunk = max(1024, budget // (SLOTS * parts * ELEM))
        self.slots = [host_buffer(parts * self.chunk, torch.float32, pin) for _ in range(SLOTS)]
        self.pin = pin
        self.engine = engine or CopyEngine(torch.device("cuda" if pin else "cpu"))
        self.io = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix="nvme-offload")

    @classmethod
    def create(cls, buckets: Sequence[Bucket], ctx: ParallelContext, root: str, buffer_mb: float,
               engine: Optional[CopyEngine] = None) -> "NvmeAdam":
        """The files of this rank, the master initialised from the parameters (every rank agrees on errors)."""
        def build() -> "NvmeAdam":
            home = cls(buckets, root, ctx.rank, buffer_mb, pin=ctx.device.type == "cuda", engine=engine)
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
        self.io.shutdown(wait=True)   # (the engine belongs to the optimizer)
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

    def stream(self, buckets: Sequence[Bucket], compute: Callable[..., Optional[Ticket]],
               read: Sequence[str] = KINDS, write: Sequence[str] = KINDS,
               stage: Optional[Callable[..., Ticket]] = None) -> None:
        """For every chunk [a, e) of every bucket: read `read` kinds into a slot (ahead, on the I/O threads)
        and stage(b, a, e, views) (ahead, e.g. the gradient's copy to the host), then
        compute(b, a, e, [master, m, v, staging] views) (it may return the ticket of a copy that reads the
        slot), then write the `write` kinds back (behind, on the I/O threads)."""
        tasks = self._tasks(buckets)
        ahead = SLOTS - 2
        reads: dict[int, cf.Future] = {}
        staged: dict[int, Ticket] = {}
        writes: list[Optional[cf.Future]] = [None] * SLOTS
        holds: list[Optional[Ticket]] = [None] * SLOTS

        def submit_read(j: int) -> None:
            slot = j % SLOTS
            if writes[slot] is not None:    # the slot's previous chunk must be on disk before reuse
                writes[slot].result()
                writes[slot] = None
            if holds[slot] is not None:     # ... and copied to the device
                holds[slot].synchronize()
                holds[slot] = None
            reads[j] = self.io.submit(self._io, "read", tasks[j], slot, read)
            if stage is not None:
                staged[j] = stage(*tasks[j], self._views(slot, tasks[j][2] - tasks[j][1]))

        try:
            for j in range(min(ahead, len(tasks))):
                submit_read(j)
            for i, task in enumerate(tasks):
                if i + ahead < len(tasks):
                    submit_read(i + ahead)
                reads.pop(i).result()
                if i in staged:
                    staged.pop(i).synchronize()
                b, a, e = task
                holds[i % SLOTS] = compute(b, a, e, self._views(i % SLOTS, e - a))
                if write:
                    writes[i % SLOTS] = self.io.submit(self._io, "write", task, i % SLOTS, write)
        finally:
            for f in list(reads.values()) + [w for w in writes if w is not None]:
                f.exception()               # wait for everything in flight (errors: the first one raised)
            for t in list(staged.values()) + [h for h in holds if h is not None]:
                t.synchronize()
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
             weight_decay: float, step: int, publish: Callable[..., Optional[Ticket]]) -> None:
        """AdamW over every bucket's state with its reduced gradient shard; publish(b, a, e, master chunk,
        staging) issues the chunk's way to the parameters (returning the ticket of a copy it started)."""
        decayed = {id(b): decay_ranges(b) for b in buckets}

        def stage(b, a, e, views):          # the gradient chunk to the host, issued with the slot's read
            return self.engine.copy(_as(views[3], b.grad.shard.dtype), b.grad.shard[a:e])

        def compute(b, a, e, views):
            p, m, v, g = views
            g = _as(g, b.grad.shard.dtype)
            adamw_flat_(p, m, v, g, clip_ranges(decayed[id(b)], a, e), lr, betas, eps, weight_decay, step)
            return publish(b, a, e, p, views[3])   # the gradient part stages the converted parameters
        self.stream(buckets, compute, stage=stage)

    def read_master(self, buckets: Sequence[Bucket], publish: Callable[[Bucket, int, int, torch.Tensor], None]) -> None:
        """Stream the master weights only (after a checkpoint load: refresh the parameters)."""
        self.stream(buckets, lambda b, a, e, views: publish(b, a, e, views[0], views[3]), read=("master",), write=())

    def read_rows(self, kind: str, b: Bucket, start: int, n: int) -> torch.Tensor:
        """Elements [start, start + n) of bucket b's segment, as a new host tensor (checkpoint save)."""
        return self.files.read(kind, (self.base[id(b)] + start) * ELEM, torch.empty(n, dtype=torch.float32))

    def write_rows(self, kind: str, b: Bucket, start: int, data: torch.Tensor) -> None:
        """Elements [start, start + numel) of bucket b's segment from `data` (checkpoint load)."""
        src = data.detach().reshape(-1).to("cpu", torch.float32).contiguous()
        self.files.write(kind, (self.base[id(b)] + start) * ELEM, src)


def _as(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The first part.numel() elements of `dtype` in the fp32 staging part's bytes (a 2-byte gradient)."""
    return part if dtype == part.dtype else part.view(torch.uint8)[: part.numel() * dtype.itemsize].view(dtype)
