"""What a training checkpoint needs from a run: small protocols, so checkpointing knows no trainer.

TorchTitan's `Stateful` idea: each part offers its state and takes it back. A run (the `Trainer` is one)
hands the checkpoint code its parts:

    ctx        ParallelContext: this rank's coordinates and groups (who writes which shard)
    chunks     the model chunks on this rank (parameters and state buffers carry `.meta`)
    optimizer  an OptimizerState, or None (evaluation: weights only)
    sampler    a DataPosition: the data stream's position at a step, and the resume check
    step       the next optimizer step to run (set by a load)
    run_config() the whole run configuration as plain data: sections model, parallel, train, checkpoint, ...
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

import torch
from torch import nn

from parallel3d.mesh import ParallelContext


class OptimizerState(Protocol):
    def state_tensors(self) -> dict[str, tuple[torch.Tensor, tuple, tuple[slice, ...]]]:
        """name -> (held data, global shape, global slices); every element held by exactly one rank. A rank
        whose piece of a tensor is several boxes returns "name#1", "name#2", ... for the further ones."""

    def load_state_tensors(self, read: Callable[[str, tuple[slice, ...]], torch.Tensor],
                           kinds: tuple[str, ...] = ...) -> None:
        """Fill the held elements from read(name, global slices), only the given kinds."""

    def scalar_state(self) -> dict[str, Any]: ...

    def load_scalar_state(self, state: dict[str, Any]) -> None: ...


class DataPosition(Protocol):
    def state_dict(self, step: int) -> dict[str, Any]:
        """JSON-able position of a run about to read `step`."""

    def check_resume(self, state: dict[str, Any]) -> None:
        """Raise ValueError if resuming from `state` would silently change the stream."""


class Checkpointable(Protocol):
    ctx: ParallelContext
    chunks: list[nn.Module]
    optimizer: Optional[OptimizerState]
    sampler: DataPosition
    step: int

    def run_config(self) -> dict[str, Any]: ...


def layout_of(run: Checkpointable) -> dict[str, Any]:
    """The parallel layout a checkpoint was written under (RNG streams are exact only under the same one)."""
    s, cfg = run.ctx.spec, run.run_config()
    p = cfg["parallel"]
    return {"world_size": s.world_size, "tp": s.tp, "cp": s.cp, "dp": s.dp, "pp": s.pp, "ep": s.ep, "etp": s.etp,
            "zero": p["zero"], "virtual_stages": p["virtual_stages"], "schedule": p["schedule"], "sp": p["sp"],
            "cp_mode": p["cp_mode"], "precision": cfg["train"]["precision"]}
