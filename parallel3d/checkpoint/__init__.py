"""Distributed checkpoints: sharded safetensors + JSON metadata, resharding on load, HF import/export.

    save_checkpoint(run, root, step)     every rank writes the shards it owns; atomic commit + `latest`
    load_checkpoint(run, directory)      any layout; a step dir or a root (follows `latest`)
    CheckpointManager(run)               the policy run_training follows (interval, keep, async, resume)

`run` is a `protocol.Checkpointable` (the Trainer is one): the parts a checkpoint saves and restores.
Modules: `protocol`, `store` (on-disk format, CheckpointReader), `contents` (what a run saves, and its names),
`save`, `load`, `manager`, `collective` (JSON all-gather, error agreement), `rng`, `hf` (Hugging Face
directories through a model's StateDictAdapter).
"""
from parallel3d.checkpoint.load import LoadResult, latest_checkpoint, load_checkpoint, resolve_checkpoint_dir
from parallel3d.checkpoint.manager import CheckpointManager, resume_source
from parallel3d.checkpoint.save import save_checkpoint
from parallel3d.checkpoint.store import CheckpointError, CheckpointReader

__all__ = ["CheckpointError", "CheckpointManager", "CheckpointReader", "LoadResult", "latest_checkpoint",
           "load_checkpoint", "resolve_checkpoint_dir", "resume_source", "save_checkpoint"]
