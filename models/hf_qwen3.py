"""Hugging Face Qwen3, Qwen3-MoE and Qwen2 <-> our Llama / MoE transformer (adapters `models/hf.py` registers).

Tensors map as for Llama (`models/hf_llama.py`), plus:

    ours                                       Hugging Face
    layers.{i}.attn.{q,k}_norm.weight  (d,)    model.layers.{i}.self_attn.{q,k}_norm.weight     (Qwen3 QK-norm)
    layers.{i}.attn.{q,k,v}_proj.bias          model.layers.{i}.self_attn.{q,k,v}_proj.bias     (Qwen2 only)
    layers.{i}.mlp.router.weight     (E, h)    model.layers.{i}.mlp.gate.weight
    layers.{i}.mlp.experts.gate_proj (E,f,h)   model.layers.{i}.mlp.experts.{e}.gate_proj.weight  (f, h)
    layers.{i}.mlp.experts.up_proj   (E,f,h)   model.layers.{i}.mlp.experts.{e}.up_proj.weight    (f, h)
    layers.{i}.mlp.experts.down_proj (E,h,f)   model.layers.{i}.mlp.experts.{e}.down_proj.weight  (h, f)

The per-expert names are what `save_pretrained` writes (transformers 5.23); import also reads the fused
in-memory form (`mlp.experts.gate_up_proj` (E, 2f, h) = [gate; up] along dim 1, `mlp.experts.down_proj`).

Config. Qwen3's `head_dim` (128 in every released size) is independent of hidden_size / heads: it maps to
model.head_dim. Qwen3-MoE routes like our softmax router: softmax over all experts in fp32, top-k of the
probabilities, renormalised over the k only when `norm_topk_prob` (model.router_norm_topk; true in the
released checkpoints, false in Qwen3MoeConfig's defaults). Its dense layers (`mlp_only_layers`) can be the
first k only (model.first_k_dense; `decoder_sparse_step` must be 1). Not expressible, refused with the reason:
sliding-window layers, non-default RoPE types, Qwen3's `attention_bias` (it also biases o_proj), shared
experts, sigmoid routing or a balancing bias. `router_aux_loss_coef` is copied to aux_loss_coef; the losses
differ in form as for Mixtral (ours per layer, summed; Hugging Face pools the layers).
"""
from __future__ import annotations

import re
from typing import Any, Iterable

import torch

from parallel3d.models.hf_experts import plain_moe_to_ours, routed_moe_to_hf
from parallel3d.models.hf_llama import DENSE_RULES
from parallel3d.checkpoint.hf import NameRules
from parallel3d.checkpoint.store import CheckpointError

QWEN_RULES = NameRules(DENSE_RULES.rules + [
    (r"layers\.(\d+)\.attn\.(q|k)_norm\.weight", "model.layers.{0}.self_attn.{1}_norm.weight"),
    (r"layers\.(\d+)\.attn\.(q|k|v)_proj\.bias", "model.layers.{0}.self_attn.{1}_proj.bias"),
])
_PROJS = ("gate_proj", "up_proj", "down_proj")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_HF_GATE = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.weight")


# ---- config ---------------------------------------------------------------------------------------------------
def _refuse(family: str, problems: list[str], direction: str = "import") -> None:
    if problems:
        verb = "cannot import" if direction == "import" else "cannot export as"
        raise CheckpointError(f"{verb} {family}: {', '.join(problems)}")


def _attention_fields(hf: dict[str, Any], family: str, model_type: str) -> dict[str, Any]:
    """The fields every Qwen config shares (Llama's plus head_dim), after refusing what we cannot run."""
    if hf.get("model_type") != model_type:
        raise CheckpointError(f"config.json has model_type {hf.get('model_type')!r}; this importer reads {model_type}")
    rope = dict(hf.get("rope_parameters") or {})
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    _refuse(family, [f"{k}={v!r}" for k, v, ok in [
        ("hidden_act", hf.get("hidden_act", "silu"), hf.get("hidden_act", "silu") == "silu"),
        ("use_sliding_window", hf.get("use_sliding_window"), not hf.get("use_sliding_window")),
        ("layer_types", sorted(layer_types), layer_types == {"full_attention"}),
        ("rope_type", rope.get("rope_type"), rope.get("rope_type", "default") == "default"),
        ("rope_scaling", hf.get("rope_scaling"), not hf.get("rope_scaling")),
        ("attention_bias (Qwen3 biases o_proj too)", hf.get("attention_bias"), not hf.get("attention_bias")),
        ("attention_dropout", hf.get("attention_dropout"), not hf.get("attention_dropout"))] if not ok])
    heads = hf["num_attention_heads"]
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, ffn_hidden_size=hf["intermediate_size"],
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))), norm_eps=hf["rms_norm_eps"],
                max_seq_len=hf.get("max_position_embeddings", 32768),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)), init_std=hf.get("initializer_range", 0.02))


def qwen3_config_to_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face Qwen3Config (config.json dict) -> ModelConfig field values."""
    return {**_attention_fields(hf, "Qwen3", "qwen3"), "qk_norm": True, "qkv_bias": False}


def qwen2_config_to_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face Qwen2Config -> ModelConfig field values (q/k/v biases, no QK-norm)."""
    return {**_attention_fields(hf, "Qwen2", "qwen2"), "qk_norm": False, "qkv_bias": True}


def qwen3_moe_config_to_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face Qwen3MoeConfig -> ModelConfig field values."""
    common = _attention_fields(hf, "Qwen3-MoE", "qwen3_moe")
    layers = hf["num_hidden_layers"]
    experts = hf.get("num_experts", hf.get("num_local_experts", 0))
    dense = sorted(set(hf.get("mlp_only_layers") or []))
    _refuse("Qwen3-MoE", [f"{k}={v!r}" for k, v, ok in [
        ("num_experts", experts, experts > 0), ("decoder_sparse_step", hf.get("decoder_sparse_step", 1),
                                                hf.get("decoder_sparse_step", 1) == 1),
        ("mlp_only_layers (only the first k layers may be dense)", dense, dense == list(range(len(dense))))] if not ok])
    return {**common, "qk_norm": True, "qkv_bias": False,
            "num_experts": experts, "moe_top_k": hf["num_experts_per_tok"],
            "moe_ffn_hidden_size": hf["moe_intermediate_size"], "num_shared_experts": 0,
            "first_k_dense": min(len(dense), layers), "router_score": "softmax",
            "router_norm_topk": bool(hf.get("norm_topk_prob", False)),
            "aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.0))}


def _hf_common(m: dict[str, Any], arch: str, model_type: str) -> dict[str, Any]:
    head_dim = m.get("head_dim") or m["hidden_size"] // m["num_heads"]
    return {"architectures": [arch], "model_type": model_type, "vocab_size": m["vocab_size"],
            "hidden_size": m["hidden_size"], "num_hidden_layers": m["num_layers"],
            "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"], "head_dim": head_dim,
            "intermediate_size": m["ffn_hidden_size"], "rms_norm_eps": m["norm_eps"],
            "max_position_embeddings": m["max_seq_len"], "tie_word_embeddings": m["tie_embeddings"],
            "hidden_act": "silu", "initializer_range": m["init_std"], "attention_bias": False,
            "use_sliding_window": False, "sliding_window": None, "attention_dropout": 0.0, "torch_dtype": "float32",
            "rope_parameters": {"rope_type": "default", "rope_theta": m["rope_theta"]}}


def _common_problems(m: dict[str, Any], qk_norm: bool, qkv_bias: bool) -> list[str]:
    return [f"{k}={m.get(k)!r}" for k, ok in [
        ("qk_norm", bool(m.get("qk_norm")) == qk_norm), ("qkv_bias", bool(m.get("qkv_bias")) == qkv_bias),
        ("rope_scaling", not m.get("rope_scaling"))] if not ok]


def fields_to_qwen3_config(m: dict[str, Any]) -> dict[str, Any]:
    _refuse("Qwen3", _common_problems(m, True, False) + ([f"num_experts={m['num_experts']}"]
                                                          if m.get("num_experts") else []), "export")
    return _hf_common(m, "Qwen3ForCausalLM", "qwen3")


def fields_to_qwen2_config(m: dict[str, Any]) -> dict[str, Any]:
    head_dim = m.get("head_dim") or m["hidden_size"] // m["num_heads"]
    problems = _common_problems(m, False, True) + [f"{k}={m.get(k)!r}" for k, ok in [
        ("num_experts", not m.get("num_experts")), ("head_dim", head_dim * m["num_heads"] == m["hidden_size"])]
        if not ok]
    _refuse("Qwen2", problems, "export")
    cfg = _hf_common(m, "Qwen2ForCausalLM", "qwen2")
    del cfg["head_dim"], cfg["attention_bias"]  # Qwen2 has neither: heads are hidden/heads wide, q/k/v always biased
    return cfg


def fields_to_qwen3_moe_config(m: dict[str, Any]) -> dict[str, Any]:
    problems = _common_problems(m, True, False) + [f"{k}={m.get(k)!r}" for k, ok in [
        ("num_experts", m.get("num_experts", 0) > 0), ("num_shared_experts", not m.get("num_shared_experts")),
        ("router_score", m.get("router_score", "softmax") == "softmax"),
        ("router_bias_update_rate", not m.get("router_bias_update_rate")),
        ("capacity_factor", not m.get("capacity_factor"))] if not ok]
    _refuse("Qwen3-MoE", problems, "export")
    return {**_hf_common(m, "Qwen3MoeForCausalLM", "qwen3_moe"), "num_experts": m["num_experts"],
            "num_experts_per_tok": m["moe_top_k"], "moe_intermediate_size": m.get("moe_ffn_hidden_size")
            or m["ffn_hidden_size"], "norm_topk_prob": bool(m.get("router_norm_topk", True)),
            "decoder_sparse_step": 1, "mlp_only_layers": list(range(m.get("first_k_dense", 0))),
            "router_aux_loss_coef": m.get("aux_loss_coef", 0.0), "output_router_logits": False}


# ---- tensors --------------------------------------------------------------------------------------------------
def qwen_to_ours(tensors: Iterable[tuple[str, torch.Tensor]], family: str) -> dict[str, torch.Tensor]:
    """Hugging Face Qwen tensors (saved or in-memory names) -> our global tensors, experts stacked."""
    return plain_moe_to_ours(tensors, family, _HF_EXPERT, _HF_GATE, QWEN_RULES)


def ours_tensor_to_qwen(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """One of our global tensors -> its Hugging Face Qwen tensors (per-expert, as save_pretrained writes)."""
    if (moe := routed_moe_to_hf(name, t, "Qwen3-MoE", "mlp")) is not None:
        return moe
    try:
        return {QWEN_RULES.to_hf(name): t}
    except KeyError:
        return {}  # buffers with no Hugging Face counterpart


class _QwenAdapter:
    architecture = ""
    family = ""

    def from_hf(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        return qwen_to_ours(tensors, self.family)

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        return ours_tensor_to_qwen(name, tensor)


class Qwen3Adapter(_QwenAdapter):
    architecture, family = "Qwen3ForCausalLM", "Qwen3"

    def accepts_model(self, fields: dict[str, Any]) -> bool:
        return not fields.get("num_experts") and bool(fields.get("qk_norm"))

    def config_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        return qwen3_config_to_fields(hf_config)

    def config_to_hf(self, fields: dict[str, Any]) -> dict[str, Any]:
        return fields_to_qwen3_config(fields)


class Qwen3MoeAdapter(_QwenAdapter):
    """Also takes MoE models with q/k/v biases, to refuse them by name (no family here expresses them)."""
    architecture, family = "Qwen3MoeForCausalLM", "Qwen3-MoE"

    def accepts_model(self, fields: dict[str, Any]) -> bool:
        return bool(fields.get("num_experts")) and bool(fields.get("qk_norm") or fields.get("qkv_bias"))

    def config_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        return qwen3_moe_config_to_fields(hf_config)

    def config_to_hf(self, fields: dict[str, Any]) -> dict[str, Any]:
        return fields_to_qwen3_moe_config(fields)


class Qwen2Adapter(_QwenAdapter):
    architecture, family = "Qwen2ForCausalLM", "Qwen2"

    def accepts_model(self, fields: dict[str, Any]) -> bool:
        return not fields.get("num_experts") and bool(fields.get("qkv_bias"))

    def config_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        return qwen2_config_to_fields(hf_config)

    def config_to_hf(self, fields: dict[str, Any]) -> dict[str, Any]:
        return fields_to_qwen2_config(fields)
