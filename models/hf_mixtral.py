"""Hugging Face Mixtral <-> our MoE transformer: tensors and config (the adapter `models/hf.py` registers).

Dense tensors (embeddings, attention, norms, head) map exactly as for Llama (`models/hf_llama.py`). The MoE MLP:

    ours                                      Hugging Face (what save_pretrained writes, transformers 4 and 5)
    layers.{i}.mlp.router.weight   (E, h)     model.layers.{i}.block_sparse_moe.gate.weight
    layers.{i}.mlp.experts.gate_proj (E,f,h)  model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight  (f, h)
    layers.{i}.mlp.experts.up_proj   (E,f,h)  model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight  (f, h)
    layers.{i}.mlp.experts.down_proj (E,h,f)  model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight  (h, f)

Import also accepts transformers 5's in-memory names (a `state_dict()` of a loaded model):
`model.layers.{i}.mlp.gate.weight` and the fused `mlp.experts.gate_up_proj` (E, 2f, h) = [w1; w3] along
dim 1, `mlp.experts.down_proj` (E, h, f). Export writes the per-expert form, which every version loads.

Semantics match: softmax over all experts, top-k, weights renormalised over the k (router_norm_topk),
SwiGLU experts, drop-less. Mixtral has no router bias: exporting a model whose auxiliary-loss-free bias is
non-zero is refused (routing would change). `router_aux_loss_coef` is copied to aux_loss_coef, but the
losses differ in form: ours is the per-layer Switch loss summed over layers with f summing to 1;
Hugging Face's pools all layers and its f sums to k.
"""
from __future__ import annotations

import re
from typing import Any, Iterable

import torch

from parallel3d.models.hf_llama import DENSE_RULES, llama_config_to_fields
from parallel3d.models.hf_experts import plain_moe_to_ours, routed_moe_to_hf
from parallel3d.checkpoint.store import CheckpointError

_PROJ_TO_W = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_W_TO_PROJ = {v: k for k, v in _PROJ_TO_W.items()}
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_HF_GATE = re.compile(r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight")


# ---- config -------------------------------------------------------------------------------------------------
def mixtral_config_to_model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face MixtralConfig (config.json dict) -> ModelConfig field values."""
    if hf.get("model_type") != "mixtral":
        raise CheckpointError(f"config.json has model_type {hf.get('model_type')!r}; this importer reads mixtral")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"hidden_act={hf['hidden_act']!r} is unsupported (experts are SwiGLU)")
    window = hf.get("sliding_window")
    if window is not None and window < hf.get("max_position_embeddings", 0):
        raise CheckpointError(f"sliding_window={window} is unsupported: parallel3d attention is fully causal")
    rope = dict(hf.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
        raise CheckpointError(f"Mixtral rope type {rope.get('rope_type')!r} / rope_scaling is unsupported")
    fields = llama_config_to_fields({**hf, "model_type": "llama"})
    fields.update(num_experts=hf["num_local_experts"], moe_top_k=hf["num_experts_per_tok"],
                  moe_ffn_hidden_size=hf["intermediate_size"], num_shared_experts=0, first_k_dense=0,
                  router_score="softmax", router_norm_topk=True,
                  aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)))
    return fields


def model_fields_to_mixtral_config(m: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig field values -> a MixtralConfig dict; refuses MoE features Mixtral cannot express."""
    problems = [f"{k}={m.get(k)!r}" for k, ok in [
        ("num_experts", m.get("num_experts", 0) > 0), ("num_shared_experts", not m.get("num_shared_experts")),
        ("first_k_dense", not m.get("first_k_dense")), ("router_score", m.get("router_score") == "softmax"),
        ("router_norm_topk", m.get("router_norm_topk", True)), ("rope_scaling", not m.get("rope_scaling"))] if not ok]
    if problems:
        raise CheckpointError(f"cannot export as Mixtral: {', '.join(problems)}")
    ffn = m.get("moe_ffn_hidden_size") or m["ffn_hidden_size"]
    rope = {"rope_type": "default", "rope_theta": m["rope_theta"]}
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": m["vocab_size"],
            "hidden_size": m["hidden_size"], "num_hidden_layers": m["num_layers"],
            "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"],
            "intermediate_size": ffn, "num_local_experts": m["num_experts"], "num_experts_per_tok": m["moe_top_k"],
            "rms_norm_eps": m["norm_eps"], "max_position_embeddings": m["max_seq_len"],
            "tie_word_embeddings": m["tie_embeddings"], "hidden_act": "silu",
            "initializer_range": m["init_std"], "router_aux_loss_coef": m["aux_loss_coef"],
            "router_jitter_noise": 0.0, "sliding_window": None, "torch_dtype": "float32",
            "head_dim": m.get("head_dim") or m["hidden_size"] // m["num_heads"], "rope_theta": m["rope_theta"], "rope_parameters": rope}


# ---- tensors (pure) -------------------------------------------------------------------------------------------
def mixtral_to_ours(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face Mixtral tensors (saved or in-memory names) -> our global tensors, experts stacked."""
    return plain_moe_to_ours(tensors.items(), "Mixtral", _HF_EXPERT, _HF_GATE, DENSE_RULES,
                             _W_TO_PROJ.__getitem__, _PROJ_TO_W.__getitem__)


def ours_to_mixtral(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our global tensors -> Hugging Face Mixtral names (per-expert, as save_pretrained writes them)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        out.update(_ours_tensor_to_mixtral(name, t))
    return out


def _ours_tensor_to_mixtral(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    if (moe := routed_moe_to_hf(name, t, "Mixtral", "block_sparse_moe", _PROJ_TO_W.__getitem__)) is not None:
        return moe
    try:
        return {DENSE_RULES.to_hf(name): t}
    except KeyError:
        return {}  # buffers with no Hugging Face counterpart


class MixtralAdapter:
    architecture = "MixtralForCausalLM"

    def accepts_model(self, fields: dict[str, Any]) -> bool:
        return bool(fields.get("num_experts"))

    def config_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        return mixtral_config_to_model_fields(hf_config)

    def config_to_hf(self, fields: dict[str, Any]) -> dict[str, Any]:
        return model_fields_to_mixtral_config(fields)

    def from_hf(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return mixtral_to_ours(dict(tensors))

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return _ours_tensor_to_mixtral(name, tensor)


def import_mixtral(hf_dir: str, out_dir: str) -> dict[str, Any]:
    """Weights-only native checkpoint of a Hugging Face Mixtral directory; returns the model fields."""
    from parallel3d.checkpoint.hf import import_hf

    fields = import_hf(hf_dir, out_dir, MixtralAdapter())
    return fields


def export_mixtral(ckpt_dir: str, out_dir: str, max_shard_bytes: int = 2 << 30) -> None:
    from parallel3d.checkpoint.hf import export_hf

    export_hf(ckpt_dir, out_dir, MixtralAdapter(), max_shard_bytes)
