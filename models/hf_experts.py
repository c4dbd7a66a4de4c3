"""Routed-expert tensors between Hugging Face MoE checkpoints and ours (Mixtral, Qwen3-MoE, DeepSeek-V3).

Ours: one stacked (E, out, in) tensor per projection, `layers.L.mlp.experts.{gate,up,down}_proj`.
Hugging Face: per-expert tensors as `save_pretrained` writes them (each family names them its own way, so
the caller collects them by (layer, projection)), or transformers' fused in-memory form
`mlp.experts.gate_up_proj` (E, 2f, h) / `mlp.experts.down_proj`.
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable, Iterable, Optional

import torch

from parallel3d.checkpoint.store import CheckpointError

HF_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
OURS_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_proj|up_proj|down_proj)")
OURS_ROUTER = re.compile(r"layers\.(\d+)\.mlp\.router\.(weight|expert_bias)")


def split_experts(prefix: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our stacked (E, out, in) projection -> `{prefix}.{e}.{...}.weight` per expert, as save_pretrained
    writes them; `prefix` holds "{e}" where the expert index goes."""
    return {prefix.format(e=e): t[e].contiguous() for e in range(t.shape[0])}


def routed_moe_to_hf(name: str, t: torch.Tensor, family: str, mlp: str,
                     proj: Callable[[str], str] = str) -> Optional[dict[str, torch.Tensor]]:
    """Export of the MoE tensors of a family with a plain softmax router (Mixtral, Qwen3-MoE): routed
    experts split per expert under `model.layers.L.{mlp}.experts.e.{proj(name)}.weight`, the router as
    `{mlp}.gate.weight`. Refuses what the family cannot express (a non-zero router bias, shared experts)
    rather than dropping it. None: `name` is not an MoE tensor."""
    if m := OURS_EXPERTS.fullmatch(name):
        return split_experts(f"model.layers.{m[1]}.{mlp}.experts.{{e}}.{proj(m[2])}.weight", t)
    if m := OURS_ROUTER.fullmatch(name):
        if m[2] == "weight":
            return {f"model.layers.{m[1]}.{mlp}.gate.weight": t}
        if torch.count_nonzero(t):
            raise CheckpointError(f"{name} is non-zero: {family} has no router bias, routing would change")
        return {}
    if ".mlp.shared_experts." in name:
        raise CheckpointError(f"{name}: {family} has no shared experts")
    return None


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


def plain_moe_to_ours(tensors: Iterable[tuple[str, torch.Tensor]], family: str, hf_expert: re.Pattern,
                      hf_gate: re.Pattern, rules: Any, proj: Callable[[str], str] = str,
                      label: Callable[[str], str] = str) -> dict[str, torch.Tensor]:
    """Import of a family with a plain softmax router (Mixtral, Qwen3-MoE): Hugging Face tensors (saved
    per-expert names, or transformers' fused in-memory ones) -> our global tensors, experts stacked.
    hf_expert matches (layer, expert, projection as the file names it; `proj` maps it to ours), hf_gate
    the router; every other tensor goes through `rules` (a NameRules) or is refused by name."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = defaultdict(dict)
    for name, t in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if m := hf_expert.fullmatch(name):
            experts[(int(m[1]), proj(m[3]))][int(m[2])] = t
        elif m := hf_gate.fullmatch(name):
            out[f"layers.{m[1]}.mlp.router.weight"] = t
        elif m := HF_FUSED.fullmatch(name):
            put_fused(out, m, t)
        else:
            try:
                out[rules.from_hf(name)] = t
            except KeyError:
                raise CheckpointError(f"unexpected tensor {name!r} in a {family} checkpoint") from None
    stack_experts(out, experts, label)
    return out
