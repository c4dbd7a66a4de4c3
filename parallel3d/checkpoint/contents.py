"""What a checkpoint holds and what it calls it: the tensors of a run (model and optimizer entries, tied copies
under their source's name, ZeRO-3 weights from the master shards) and the on-disk names (step directories,
"optim.<kind>.<param>", per-rank "optim.local.r<rank>.*"). save.py writes them, load.py reads them back.
"""
from __future__ import annotations

import re

import torch

from parallel3d.checkpoint.protocol import Checkpointable
from parallel3d.checkpoint.store import PIECE
from parallel3d.params import real_part

LATEST = "latest"
STEP_DIR = re.compile(r"step_(\d{8})")
Entries = dict[str, tuple[torch.Tensor, tuple[int, ...], tuple[slice, ...]]]


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def optim_tensor_name(key: str, tied: dict[str, str]) -> str:
    """Optimizer key "exp_avg/<param>" (or a further piece of it, "exp_avg/<param>#2") -> on-disk tensor
    "optim.exp_avg.<canonical param>".

    The "optim." prefix keeps optimizer state out of weight consumers (export_hf skips it); tied copies
    (lm_head tied to embed on another stage) map to their source so the state reloads under any pp."""
    kind, _, param = base_name(key).partition("/")
    return f"optim.{kind}.{tied.get(param, param)}"


def base_name(key: str) -> str:
    """A key or on-disk name without its piece suffix ("#2": a rank's further box of one tensor)."""
    return key.split(PIECE, 1)[0]


def _piece_suffix(key: str) -> str:
    """"#2" of a further piece's key (a rank's second box of one tensor), "" for the first: the entry
    keeps it so that several boxes of one tensor can sit in one file (store.write_shard_file)."""
    _, sep, i = key.partition(PIECE)
    return sep + i


def local_tensor_name(key: str, rank: int) -> str:
    """Per-rank optimizer state "residual/<param>" of rank 3 -> "optim.local.r00003.residual.<param>"."""
    return f"optim.local.r{rank:05d}.{key.replace('/', '.', 1)}"


def tied_names(run: Checkpointable) -> dict[str, str]:
    """Parameter name -> the name its data is stored under (itself, or the tied source)."""
    return {name: p.meta.tied_to or name
            for chunk in run.chunks for name, p in chunk.named_parameters()}


def materialized(p: torch.Tensor) -> bool:
    """False for a ZeRO-3 parameter whose storage is freed between steps (its master shard is the weight)."""
    need = (p.storage_offset() + p.numel()) * p.element_size()
    return p.untyped_storage().nbytes() >= need


def collect_tensors(run: Checkpointable) -> tuple[Entries, Entries]:
    """(model, optimizer) entries of this rank: name -> (local real data, global shape, slices)."""
    tied = tied_names(run)
    if run.optimizer is None:
        raise TypeError("a run without an optimizer (evaluation) has no training state to checkpoint")
    state = run.optimizer.state_tensors()
    optim: Entries = {optim_tensor_name(key, tied) + _piece_suffix(key): (data, tuple(shape), tuple(slices))
                      for key, (data, shape, slices) in state.items()}
    local = getattr(run.optimizer, "local_state_tensors", dict)()  # e.g. compression residuals: this rank's own
    optim.update({local_tensor_name(key, run.ctx.rank): (t, tuple(t.shape), tuple(slice(0, n) for n in t.shape))
                  for key, t in local.items()})
    masters: dict[str, list[str]] = {}   # parameter name -> its master keys (pieces), for ZeRO-3's freed weights
    for key in state:
        kind, _, param = base_name(key).partition("/")
        if kind == "master":
            masters.setdefault(param, []).append(key)
    model: Entries = {}
    for chunk in run.chunks:
        for name, p in chunk.named_parameters():
            if materialized(p):
                model.setdefault(tied[name], (real_part(p.detach(), p.meta), tuple(p.meta.global_shape),
                                              tuple(p.meta.slices)))
            else:  # ZeRO-3: write the weight from this rank's master pieces
                for key in masters.get(name, ()):
                    data, shape, slices = state[key]
                    model.setdefault(tied[name] + _piece_suffix(key), (data.to(p.dtype), tuple(shape),
                                                                        tuple(slices)))
        for name, b in state_buffers(chunk):
            model.setdefault(name, (real_part(b.detach(), b.meta), tuple(b.meta.global_shape), tuple(b.meta.slices)))
    return model, optim


def state_buffers(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Buffers that are model state (they carry `.meta`, e.g. the MoE router's expert_bias)."""
    return [(n, b) for n, b in module.named_buffers() if getattr(b, "meta", None) is not None]
