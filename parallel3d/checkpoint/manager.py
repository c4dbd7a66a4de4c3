"""When to save and where to resume from: the checkpoint policy `run_training` follows.

    manager = CheckpointManager(run)         # run: a Checkpointable (the Trainer); reads its config's
                                             # checkpoint section (save_dir, interval, keep, async_save)
    manager.resume()                         # torchrun restart -> save_dir/latest; else load_dir; else nothing
    ... after every optimizer step: manager.after_step()   (interval saves; commits finished async saves)
    manager.finish()                         # final save (if save_dir) and wait for any async save

An async save is committed as soon as every rank's background write is done: while one is pending, each
step all-reduces a single "done" flag (min over the world), so all ranks commit together on the training
thread and no collective ever runs on the writer threads.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional

import torch

from parallel3d import comm
from parallel3d.checkpoint.protocol import Checkpointable
from parallel3d.checkpoint.load import LoadResult, latest_checkpoint, load_checkpoint
from parallel3d.checkpoint.save import PendingSave, begin_save, finish_save
from parallel3d.host_sync import read_float


def restart_count() -> int:
    """How often torchrun restarted this job (TORCHELASTIC_RESTART_COUNT; 0 on the first attempt)."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def resume_source(checkpoint_cfg: "CheckpointPolicy") -> Optional[str]:
    """The checkpoint to start from: after a torchrun restart the newest complete one in save_dir (where the
    failed attempt saved), otherwise checkpoint.load_dir (None: start from scratch)."""
    if restart_count() > 0 and latest_checkpoint(checkpoint_cfg.save_dir) is not None:
        return checkpoint_cfg.save_dir
    return checkpoint_cfg.load_dir


@dataclass
class CheckpointPolicy:
    """The run's checkpoint settings (its config's `checkpoint` section)."""
    save_dir: Optional[str] = None
    load_dir: Optional[str] = None
    interval: int = 0
    keep: int = 0
    async_save: bool = False

    @classmethod
    def of(cls, run: Checkpointable) -> "CheckpointPolicy":
        section = run.run_config().get("checkpoint") or {}
        return cls(**{f.name: section[f.name] for f in fields(cls) if f.name in section})


class CheckpointManager:
    def __init__(self, run: Checkpointable, log: bool = True) -> None:
        self.run, self.cfg = run, CheckpointPolicy.of(run)
        self.pending: Optional[PendingSave] = None
        self.last_saved: Optional[int] = None   # step of the newest committed (or pending) save
        self.log = log and run.ctx.rank == 0

    def _say(self, text: str) -> None:
        if self.log:
            print(f"[checkpoint] {text}", flush=True)

    def resume(self) -> Optional[LoadResult]:
        source = resume_source(self.cfg)
        if not source:
            return None
        result = load_checkpoint(self.run, source)
        if result.weights_only:
            self._say(f"initialised weights from {result.path} (weights only: step 0, fresh optimizer)")
        else:
            restart = f" after restart {restart_count()}" if restart_count() else ""
            layout = "same layout" if result.same_layout else "resharded to a new layout"
            self._say(f"resumed from {result.path} at step {result.step}{restart} ({layout})")
            save_dir = self.cfg.save_dir
            saved_here = bool(save_dir) and os.path.isdir(save_dir) and os.path.samefile(
                os.path.dirname(os.path.abspath(result.path)), save_dir)
            if saved_here:
                self.last_saved = result.step  # that exact state is already saved there
        return result

    def save(self) -> None:
        """Checkpoint the run's current step now (async when configured)."""
        self.wait()
        step = self.run.step
        self.pending = begin_save(self.run, self.cfg.save_dir, step, async_save=self.cfg.async_save)
        self.last_saved = step
        if not self.cfg.async_save:
            self.wait()

    def poll(self) -> None:
        """Commit a pending async save if every rank has finished writing it (one tiny all-reduce)."""
        if self.pending is None:
            return
        ctx = self.run.ctx
        done = torch.full((1,), 1.0 if self.pending.written() else 0.0, device=ctx.device)
        comm.all_reduce(done, ctx.world, op="min")
        if read_float(done, ctx.stats.syncs, "checkpoint", nominal=1.0) == 1.0:
            self.wait()

    def wait(self) -> None:
        """Finish and commit the pending save, if any (every rank calls)."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            path = finish_save(self.run, pending, keep=self.cfg.keep)
            self._say(f"saved {path}")

    def after_step(self) -> None:
        self.poll()
        interval, step = self.cfg.interval, self.run.step
        if self.cfg.save_dir and interval > 0 and step % interval == 0 and self.last_saved != step:
            self.save()

    def finish(self) -> None:
        if self.cfg.save_dir and self.last_saved != self.run.step:
            self.save()
        self.wait()
