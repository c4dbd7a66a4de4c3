"""Routed-expert tensors between Hugging Face MoE checkpoints and ours (Mixtral, Qwen3-MoE, DeepSeek-V3).

Ours: one stacked (E, out, in) tensor per projection, `layers.L.mlp.experts.{gate,up,down}_proj`.
Hugging Face: per-expert tensors as `save_pretrained` writes them (each family names them its own way, so
the caller collects them by (layer, projection)), or transformers' fused in-memory form
`mlp.experts.gate_up_proj` (E, 2f, h) / `mlp.experts.down_proj`.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from parallel3d.checkpoint.store import CheckpointError

HF_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def put_fused(out: dict[str, torch.Tensor], m: re.Match, t: torch.Tensor) -> None:
    """A fused transformers tensor (matched by HF_FUSED) -> our stacked projections."""
    if m[2] == "down_proj":
        out[f"layers.{m[1]}.mlp.experts.down_proj"] = t
        return
    gate, up = t.chunk(2, dim=1)  # (E, f, h) each
    out[f"layers.{m[1]}.mlp.experts.gate_proj"] = gate.contiguous()
    out[f"layers.{m[1]}.mlp.experts.up_proj"] = up.contiguous()


def stack_experts(out: dict[str, torch.Tensor], experts: dict, label: Callable[[str], str] = str) -> None:
    """experts[(layer, proj)][e] = tensor -> out["layers.{layer}.mlp.experts.{proj}"] = (E, ...) stack;
    a missing expert index is a corrupt checkpoint (`label` names the projection as the file does)."""
    for (layer, proj), per_expert in experts.items():
        if sorted(per_expert) != list(range(len(per_expert))):
            raise CheckpointError(f"layer {layer} {label(proj)}: experts {sorted(per_expert)} are not 0..E-1")
        out[f"layers.{layer}.mlp.experts.{proj}"] = torch.stack([per_expert[e] for e in range(len(per_expert))])
