"""Loading a checkpoint under any layout: each rank reads only the slices its parameters and optimizer shards
cover (`p.meta.slices`), whatever tp/pp/dp/cp/ep/ZeRO/virtual stages wrote them.

Failure handling: everything that can fail on a rank (a missing, truncated or corrupt file, a checkpoint of
another model shape, a data-stream mismatch) is checked before any state changes that involve collectives,
then the ranks agree (`agree_on_errors`), so either all ranks load or all raise the same CheckpointError
naming the file; none is left hanging in a collective. Nothing is unpickled (safetensors and JSON only).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from parallel3d.checkpoint.collective import agree_on_errors
from parallel3d.checkpoint.rng import reseed_rng, restore_rng
from parallel3d.checkpoint.protocol import Checkpointable, layout_of
from parallel3d.checkpoint.contents import (LATEST, STEP_DIR, local_tensor_name, materialized, optim_tensor_name,
                                            state_buffers, tied_names)
from parallel3d.checkpoint.save import is_complete
from parallel3d.checkpoint.store import METADATA, CheckpointError, CheckpointReader
from parallel3d.params import load_global_slice

# Model fields that change parameter shapes or names: they must match the checkpoint's.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
                "tie_embeddings", "num_experts", "moe_ffn_hidden_size", "num_shared_experts", "first_k_dense",
                "head_dim", "qk_norm", "qkv_bias", "attention_type", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


@dataclass
class LoadResult:
    path: str               # the step directory actually read
    step: int               # the step training continues from (0 for weights-only checkpoints)
    weights_only: bool      # True: model weights only (fresh optimizer, step 0)
    same_layout: bool       # True: per-rank RNG restored exactly; False: reseeded


def resolve_checkpoint_dir(path: str) -> str:
    """A step directory (holding metadata.json), or a save root: follow `latest` (else the newest complete)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if is_complete(path):
        return path
    latest = os.path.join(path, LATEST)
    if os.path.isfile(latest):
        with open(latest) as f:
            name = f.read().strip()
        target = os.path.join(path, name)
        if STEP_DIR.fullmatch(name) and not os.path.exists(target) and is_complete(target + ".old"):
            return target + ".old"  # killed while replacing a re-saved step: the old copy is intact
        if not STEP_DIR.fullmatch(name) or not is_complete(target):
            raise CheckpointError(f"{latest} names {name!r}, which is not a complete checkpoint in {path}")
        return target
    steps = sorted(e for e in os.listdir(path) if STEP_DIR.fullmatch(e) and is_complete(os.path.join(path, e)))
    if steps:
        return os.path.join(path, steps[-1])
    raise CheckpointError(f"{path} holds no complete checkpoint (no {METADATA}, no {LATEST} file, no complete "
                          f"step_* directory)")


def latest_checkpoint(root: Optional[str]) -> Optional[str]:
    """The complete checkpoint `root/latest` names, or None (no root, no `latest`)."""
    if not root or not os.path.isfile(os.path.join(root, LATEST)):
        return None
    return resolve_checkpoint_dir(root)


def check_model_config(reader: CheckpointReader, model_cfg: dict[str, Any]) -> None:
    saved = reader.meta.get("model") or {}
    diff = [f"{k}={saved[k]!r} (config: {model_cfg[k]!r})" for k in SHAPE_FIELDS
            if k in saved and k in model_cfg and saved[k] != model_cfg[k]]
    if diff:
        raise CheckpointError(f"{os.path.join(reader.directory, METADATA)}: checkpoint of another model shape: "
                              f"{', '.join(diff)}")


def load_model_weights(reader: CheckpointReader, chunks: Sequence[torch.nn.Module]) -> None:
    """Each parameter's and state buffer's slice (meta.slices; vocab padding rows zeroed). Tied copies read
    their source. ZeRO-3 parameters (storage freed between steps) are only checked: the optimizer publishes
    them from the master weights."""
    tensors = reader.meta["tensors"]
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            source = p.meta.tied_to or name
            if source not in tensors and name in tensors:
                source = name
            shape = reader.global_shape(source)
            if tuple(shape) != tuple(p.meta.global_shape):
                raise CheckpointError(f"{reader.directory}: tensor {source!r} has shape {tuple(shape)} but the "
                                      f"model expects {tuple(p.meta.global_shape)} (checkpoint of another model?)")
            if materialized(p):
                load_global_slice(p, reader.read(source, p.meta.slices))
            else:
                reader.check(source, p.meta.slices)
        for name, b in state_buffers(chunk):
            if name not in tensors and reader.meta.get("weights_only"):
                continue  # e.g. an import without this state: keep its initial value
            with torch.no_grad():
                load_global_slice(b, reader.read(name, b.meta.slices))


def _validate_optimizer(reader: CheckpointReader, run: Checkpointable, tied: dict[str, str]) -> None:
    """Fail early (before collectives) when optimizer tensors are missing, misshapen or damaged."""
    opt = run.optimizer
    for key, (_, shape, slices) in opt.state_tensors().items():
        name = optim_tensor_name(key, tied)
        if name not in reader.meta["tensors"]:
            raise CheckpointError(f"{reader.directory} holds no optimizer tensor {name!r} (saved by another "
                                  f"optimizer?)")
        if tuple(reader.global_shape(name)) != tuple(shape):
            raise CheckpointError(f"{reader.directory}: {name!r} has shape {reader.global_shape(name)}, the "
                                  f"optimizer expects {tuple(shape)}")
        reader.check(name, slices)


def _read_rng(reader: CheckpointReader, rank: int) -> dict:
    name = (reader.meta.get("rng_files") or {}).get(str(rank))
    if name is None:
        raise CheckpointError(f"{os.path.join(reader.directory, METADATA)} lists no RNG state for rank {rank}")
    path = reader.verified_file(name)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"RNG state file {path} is corrupt: {e}") from e


def _load_local_state(reader: CheckpointReader, run: Checkpointable, errors: list[str]) -> None:
    """Per-rank optimizer state (compression residuals), only under the layout that wrote it: every entry
    this rank wrote (a checkpoint without any leaves the optimizer's fresh state)."""
    opt = run.optimizer
    prefix = local_tensor_name("", run.ctx.rank)
    state = {}
    for name in reader.meta["tensors"]:
        if name.startswith(prefix) and hasattr(opt, "load_local_state_tensors"):
            key = name[len(prefix):].replace(".", "/", 1)
            try:
                state[key] = reader.read(name, tuple(slice(0, n) for n in reader.global_shape(name)))
            except CheckpointError as e:
                errors.append(str(e))
    if state:
        opt.load_local_state_tensors(state)


def _load_optimizer(reader: CheckpointReader, run: Checkpointable, weights_only: bool,
                    same_layout: bool = False) -> None:
    """Optimizer tensors through `read(name, slices)` (every rank calls: ZeRO re-gathers parameters inside).

    A failing read is recorded and answered with zeros, so this rank still joins the optimizer's collectives;
    the ranks then agree on the error instead of hanging. Weights-only: the masters come from the weights."""
    opt, ctx, tied = run.optimizer, run.ctx, tied_names(run)
    errors: list[str] = []

    def read(key: str, slices) -> torch.Tensor:
        kind, _, param = key.partition("/")
        name = tied.get(param, param) if weights_only else optim_tensor_name(key, tied)
        try:
            return reader.read(name, slices).float()
        except CheckpointError as e:
            errors.append(str(e))
            return torch.zeros([s.stop - s.start for s in slices])

    if weights_only:
        opt.load_state_tensors(read, kinds=("master",))
    else:
        opt.load_state_tensors(read)
        opt.load_scalar_state(dict(reader.meta.get("optimizer") or {}))
        if same_layout:
            _load_local_state(reader, run, errors)
    agree_on_errors(errors[0] if errors else None, ctx.world, ctx.device, "loading optimizer state")


def load_checkpoint(run: Checkpointable, directory: str, model_only: bool = False) -> LoadResult:
    """Load `directory` (a step dir, or a save root following `latest`) into `run` (every rank calls).

    Full checkpoints restore weights, optimizer state (tensors and scalars), data position, step and RNG;
    weights-only checkpoints (e.g. a Hugging Face import) and `model_only=True` (evaluation) load weights,
    derive the optimizer's master weights from them (Adam moments stay fresh) and leave the step at 0."""

    ctx = run.ctx
    error, result, reader = None, None, None
    try:
        path = resolve_checkpoint_dir(directory)
        reader = CheckpointReader(path)
        check_model_config(reader, run.run_config()["model"])
        meta = reader.meta
        full = not model_only and not meta.get("weights_only", False)
        load_model_weights(reader, run.chunks)
        result = LoadResult(path, int(meta.get("step", 0)) if full else 0, not full, False)
        if full:
            _validate_optimizer(reader, run, tied_names(run))
            saved = meta.get("layout")
            if saved is not None:
                saved = {"etp": 1, **saved}  # checkpoints written before parallel.etp existed
            result.same_layout = saved == layout_of(run)
            try:
                run.sampler.check_resume(dict(meta.get("data") or {}))
            except ValueError as e:
                raise CheckpointError(str(e)) from None
            if result.same_layout:  # nothing draws random numbers between here and training
                state = _read_rng(reader, ctx.rank)
                try:
                    restore_rng(state, ctx.device)
                except (KeyError, ValueError, TypeError) as e:
                    raise CheckpointError(f"RNG state of rank {ctx.rank} in {path} is malformed: {e!r}") from e
            else:
                reseed_rng(run.run_config()["train"]["seed"], result.step, ctx.rank, ctx.device)
    except (CheckpointError, OSError, ValueError, KeyError, TypeError) as e:
        error = f"{e}" if isinstance(e, CheckpointError) else f"{directory}: {type(e).__name__}: {e}"
    agree_on_errors(error, ctx.world, ctx.device, "loading checkpoint")
    if run.optimizer is not None:  # an evaluation-only run has none
        _load_optimizer(reader, run, result.weights_only, result.same_layout)
    if not result.weights_only:
        run.step = result.step
    return result
