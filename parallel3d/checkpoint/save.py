"""Saving a training checkpoint: every rank writes the shards it owns; rank 0 commits atomically.

On disk (see docs/checkpoints.md and `store.py` for the metadata format):

    ROOT/latest                       "step_00000010": the newest complete checkpoint (replaced atomically)
    ROOT/step_00000010/metadata.json  format, step, model config, layout, data position, optimizer scalars,
                                      full config, and per tensor its global shape and the slices in each file
    ROOT/step_00000010/config.yaml    a runnable config (pretrain.py / evaluate.py accept it)
    ROOT/step_00000010/model-r00003.safetensors   model weights rank 3 owns (real rows: no vocab padding)
    ROOT/step_00000010/optim-r00003.safetensors   "optim.<kind>.<param>": fp32 master, exp_avg, exp_avg_sq
    ROOT/step_00000010/rng-r00003.json            rank 3's torch / numpy / python RNG states

Dedup: a slice held identically by several ranks (dp/cp replicas, TP-replicated norms and kv heads, tied
embeddings on the first and last stage, un-sharded optimizer state) is written once, by its lowest rank.

Atomicity: shards go to ROOT/step_N.tmp; after every rank reported success (an all-gather that doubles as
the barrier) rank 0 writes metadata.json, renames the directory to ROOT/step_N, then replaces `latest`. A
save interrupted at any point leaves the previous checkpoint and `latest` untouched; the next save removes
the stale .tmp directory. With async_save the tensors are copied to host memory first and a background
thread writes them; the commit (collectives) always runs on the training thread (`finish_save`).
"""
from __future__ import annotations

import copy
import json
import os
import re
import shutil
import threading
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from parallel3d.checkpoint.collective import agree_on_errors, all_gather_json, entry_key, first_holders
from parallel3d.checkpoint.contents import LATEST, STEP_DIR, Entries, base_name, collect_tensors, step_dir_name
from parallel3d.checkpoint.protocol import Checkpointable, layout_of
from parallel3d.checkpoint.rng import capture_rng
from parallel3d.checkpoint.store import (METADATA, CheckpointError, merge_indices, sha256_file, write_metadata,
                                         write_shard_file)


def _owned(entries: Entries, run: Checkpointable) -> Entries:
    keys = [entry_key(base_name(name), slices) for name, (_, _, slices) in entries.items()]
    owners = first_holders(keys, run.ctx.world, run.ctx.device)
    return {name: e for (name, e), own in zip(entries.items(), owners) if own}


def _metadata_fields(run: Checkpointable, step: int) -> dict[str, Any]:
    cfg = run.run_config()
    return {"step": step, "weights_only": False, "model": cfg["model"],
            "layout": layout_of(run), "data": run.sampler.state_dict(step),
            "optimizer": run.optimizer.scalar_state(), "config": cfg}


@dataclass
class PendingSave:
    """A save whose shards are being (or have been) written; `finish_save` commits it."""
    root: str
    step: int
    tmp: str
    fields: dict
    thread: Optional[threading.Thread] = None
    result: dict = field(default_factory=dict)

    @property
    def final(self) -> str:
        return os.path.join(self.root, step_dir_name(self.step))

    def written(self) -> bool:
        return self.thread is None or not self.thread.is_alive()


def _write_rank_files(tmp: str, rank: int, model: Entries, optim: Entries, rng: dict) -> dict[str, Any]:
    parts = []
    for prefix, entries in (("model", model), ("optim", optim)):
        if entries:
            parts.append(write_shard_file(tmp, f"{prefix}-r{rank:05d}.safetensors", entries))
    index = merge_indices(parts) if parts else {"tensors": {}, "files": {}}
    rng_file = f"rng-r{rank:05d}.json"
    path = os.path.join(tmp, rng_file)
    with open(path, "w") as f:
        json.dump(rng, f)
        f.flush()
        os.fsync(f.fileno())
    index["files"][rng_file] = {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}
    index["rng"] = {str(rank): rng_file}
    return index


def clean_stale(root: str) -> None:
    """Remove leftovers of interrupted saves (never a complete checkpoint)."""
    for entry in os.listdir(root):
        if re.fullmatch(r"step_\d{8}\.(tmp|old)", entry):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
        elif entry == LATEST + ".tmp":
            os.remove(os.path.join(root, entry))


def begin_save(run: Checkpointable, root: str, step: int, async_save: bool = False) -> PendingSave:
    """Start a checkpoint of `run` at `step` under `root` (every rank calls)."""
    ctx = run.ctx
    tmp = os.path.join(root, step_dir_name(step) + ".tmp")
    error = None
    if ctx.rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            clean_stale(root)
            os.makedirs(tmp)
        except OSError as e:
            error = f"cannot create checkpoint directory {tmp}: {e}"
    agree_on_errors(error, ctx.world, ctx.device, "checkpoint save")  # also: tmp exists before anyone writes
    model, optim = collect_tensors(run)
    model, optim = _owned(model, run), _owned(optim, run)
    pending = PendingSave(root, step, tmp, _metadata_fields(run, step) if ctx.rank == 0 else {})
    rng = capture_rng(ctx.device)
    if async_save:  # snapshot now (device -> host copies), write while training continues
        model, optim = ({k: (t.detach().to("cpu", copy=True), s, sl) for k, (t, s, sl) in e.items()}
                        for e in (model, optim))

    def work() -> None:
        try:
            pending.result["index"] = _write_rank_files(tmp, ctx.rank, model, optim, rng)
        except Exception as e:  # reported to every rank by finish_save, never lost in the thread
            pending.result["error"] = f"writing {tmp} failed: {type(e).__name__}: {e}"

    if async_save:
        pending.thread = threading.Thread(target=work, name=f"checkpoint-save-{step}", daemon=True)
        pending.thread.start()
    else:
        work()
    return pending


def _write_config(run: Checkpointable, directory: str, load_dir: str) -> None:
    """config.yaml that resumes from this checkpoint (`pretrain.py --config DIR/config.yaml`)."""
    cfg = copy.deepcopy(run.run_config())
    cfg["parallel"]["dp"], cfg["train"]["num_microbatches"] = 0, 0  # portable to any world size
    cfg["checkpoint"]["load_dir"] = load_dir
    with open(os.path.join(directory, "config.yaml"), "w") as f:
        yaml.safe_dump(cfg, f, sort_keys=False)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST))
    _fsync_dir(root)


def _publish(pending: PendingSave) -> None:
    """tmp -> final (replacing an older save of the same step), then `latest`."""
    _fsync_dir(pending.tmp)
    final, old = pending.final, pending.final + ".old"
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(pending.tmp, final)
    write_latest(pending.root, os.path.basename(final))
    shutil.rmtree(old, ignore_errors=True)


def prune(root: str, keep: int) -> list[str]:
    """Delete all but the newest `keep` complete checkpoints (never the one `latest` names). keep=0: none."""
    if keep <= 0:
        return []
    try:
        with open(os.path.join(root, LATEST)) as f:
            protected = f.read().strip()
    except OSError:
        protected = ""
    steps = sorted(e for e in os.listdir(root) if STEP_DIR.fullmatch(e) and os.path.isdir(os.path.join(root, e)))
    victims = [e for e in steps[:-keep] if e != protected] if len(steps) > keep else []
    for e in victims:
        shutil.rmtree(os.path.join(root, e), ignore_errors=True)
    return victims


def finish_save(run: Checkpointable, pending: PendingSave, keep: int = 0) -> str:
    """Wait for this rank's writes, agree that all ranks succeeded, commit on rank 0. Returns the directory."""
    ctx = run.ctx
    if pending.thread is not None:
        pending.thread.join()
    parts = all_gather_json(pending.result, ctx.world, ctx.device)  # every rank has finished writing
    failed = [(r, p["error"]) for r, p in enumerate(parts) if p.get("error")]
    if failed:  # every rank sees the same parts: all raise together; the .tmp is cleared by the next save
        raise CheckpointError(f"checkpoint save failed: rank {failed[0][0]}: {failed[0][1]}")
    error = None
    if ctx.rank == 0:
        try:
            index = merge_indices(p["index"] for p in parts)
            rng = {k: v for p in parts for k, v in p["index"]["rng"].items()}
            write_metadata(pending.tmp, index, rng_files=rng, **pending.fields)
            _write_config(run, pending.tmp, load_dir=pending.final)
            _publish(pending)
            prune(pending.root, keep)
        except OSError as e:
            error = f"committing {pending.final} failed: {e}"
    agree_on_errors(error, ctx.world, ctx.device, "checkpoint save")
    return pending.final


def save_checkpoint(run: Checkpointable, root: str, step: Optional[int] = None, keep: int = 0) -> str:
    """Synchronous save of `run` at `step` (default run.step) under `root`; returns the step dir."""
    pending = begin_save(run, root, run.step if step is None else step)
    return finish_save(run, pending, keep)


def is_complete(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, METADATA))
