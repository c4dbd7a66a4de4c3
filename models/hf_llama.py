"""Hugging Face Llama <-> our Llama: names and config (the adapter `models/hf.py` registers).

    ours                               Hugging Face
    embed.weight                       model.embed_tokens.weight
    layers.{i}.attn_norm.weight        model.layers.{i}.input_layernorm.weight
    layers.{i}.attn.{q,k,v,o}_proj     model.layers.{i}.self_attn.{q,k,v,o}_proj.weight
    layers.{i}.mlp_norm.weight         model.layers.{i}.post_attention_layernorm.weight
    layers.{i}.mlp.{gate,up,down}_proj model.layers.{i}.mlp.{gate,up,down}_proj.weight
    norm.weight                        model.norm.weight
    lm_head.weight                     lm_head.weight   (absent when embeddings are tied)
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from parallel3d.checkpoint.hf import NameRules
from parallel3d.checkpoint.store import CheckpointError

DENSE_RULES = NameRules([  # (our regex, HF template)
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"layers\.(\d+)\.attn\.(q|k|v|o)_proj\.weight", "model.layers.{0}.self_attn.{1}_proj.weight"),
    (r"layers\.(\d+)\.mlp_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "model.layers.{0}.mlp.{1}_proj.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
])


def llama_config_to_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face LlamaConfig (config.json dict) -> ModelConfig field values."""
    if hf.get("model_type", "llama") != "llama":
        raise CheckpointError(f"config.json has model_type {hf.get('model_type')!r}; this importer reads llama")
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    heads = hf["num_attention_heads"]
    fields = dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                  num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                  ffn_hidden_size=hf["intermediate_size"], rope_theta=float(theta), norm_eps=hf["rms_norm_eps"],
                  max_seq_len=hf.get("max_position_embeddings", 2048),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  init_std=hf.get("initializer_range", 0.02))
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        fields["head_dim"] = hf["head_dim"]  # decoupled from hidden_size / heads
    if scaling:
        fields["rope_scaling"] = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings")}
    return fields


def fields_to_llama_config(m: dict[str, Any]) -> dict[str, Any]:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m["vocab_size"],
           "hidden_size": m["hidden_size"], "num_hidden_layers": m["num_layers"],
           "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"],
           "intermediate_size": m["ffn_hidden_size"], "rms_norm_eps": m["norm_eps"],
           "max_position_embeddings": m["max_seq_len"], "tie_word_embeddings": m["tie_embeddings"],
           "hidden_act": "silu", "initializer_range": m["init_std"], "torch_dtype": "float32",
           "head_dim": m.get("head_dim") or m["hidden_size"] // m["num_heads"], "attention_bias": False, "mlp_bias": False,
           "rope_theta": m["rope_theta"]}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m["rope_theta"]}
    if m.get("rope_scaling"):
        rope = {"rope_type": "llama3", "rope_theta": m["rope_theta"], **m["rope_scaling"]}
        cfg["rope_scaling"] = dict(rope)
    cfg["rope_parameters"] = rope
    return cfg


class LlamaAdapter:
    architecture = "LlamaForCausalLM"

    def accepts_model(self, fields: dict[str, Any]) -> bool:
        return not fields.get("num_experts")

    def config_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        return llama_config_to_fields(hf_config)

    def config_to_hf(self, fields: dict[str, Any]) -> dict[str, Any]:
        return fields_to_llama_config(fields)

    def from_hf(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out = {}
        for name, t in tensors:
            try:
                out[DENSE_RULES.from_hf(name)] = t
            except KeyError:
                raise CheckpointError(f"unexpected tensor {name!r} in a Llama checkpoint") from None
        return out

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        try:
            return {DENSE_RULES.to_hf(name): tensor}
        except KeyError:
            return {}  # buffers with no Hugging Face counterpart
