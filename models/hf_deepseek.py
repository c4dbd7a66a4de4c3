"""Hugging Face DeepseekV3ForCausalLM <-> our MoE transformer with Multi-Latent Attention (the adapter
`models/hf.py` registers). Embeddings, layer norms, the dense MLPs, final norm and head map as for Llama
(`models/hf_llama.py`); attention and MoE:

    ours                                     Hugging Face (as save_pretrained writes it)
    layers.{i}.attn.q_a_proj.weight          model.layers.{i}.self_attn.q_a_proj.weight          (r_q, h)
    layers.{i}.attn.q_a_norm.weight          model.layers.{i}.self_attn.q_a_layernorm.weight
    layers.{i}.attn.q_b_proj.weight   *      model.layers.{i}.self_attn.q_b_proj.weight          (n*d_qk, r_q)
    layers.{i}.attn.q_proj.weight     *      model.layers.{i}.self_attn.q_proj.weight  (q_lora_rank null)
    layers.{i}.attn.kv_a_proj.weight  *      model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight (r_kv+d_rope, h)
    layers.{i}.attn.kv_a_norm.weight         model.layers.{i}.self_attn.kv_a_layernorm.weight
    layers.{i}.attn.kv_b_proj.weight         model.layers.{i}.self_attn.kv_b_proj.weight  (n*(d_nope+d_v), r_kv)
    layers.{i}.attn.o_proj.weight            model.layers.{i}.self_attn.o_proj.weight
    layers.{i}.mlp.router.weight             model.layers.{i}.mlp.gate.weight
    layers.{i}.mlp.router.expert_bias        model.layers.{i}.mlp.gate.e_score_correction_bias
    layers.{i}.mlp.experts.{gate,up,down}_proj (E, ., .)   model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight
    layers.{i}.mlp.shared_experts.{gate,up,down}_proj      model.layers.{i}.mlp.shared_experts.{..}_proj.weight

Import also reads transformers 5's in-memory names (fused `mlp.experts.gate_up_proj` (E, 2f, h) = [gate; up]).

* RoPE layout. DeepSeek stores the rotary dims of q and k_r interleaved (pairs (x0, x1), (x2, x3), ...;
`rope_interleave: true`); our RoPE rotates halves. Rotating interleaved pairs equals rotating halves of the
de-interleaved vector [x0, x2, ... | x1, x3, ...], and the q.k products only need q and k permuted alike, so
import permutes the rope rows of W_qb / W_q (per head) and of W_kva that way and export puts them back:
the exported directory keeps DeepSeek's layout (`rope_interleave: true`).

The adapter reads the head layout from the config (`config_from_hf` / `config_to_hf`) before tensors pass:
parallel3d.checkpoint.hf calls those first. Not imported: multi-token-prediction layers (layer indices >=
num_hidden_layers; transformers has no MTP either: they are skipped, and our MTP modules (models/mtp.py,
`mtp.*`) are not exported) and FP8 block-quantised checkpoints
(`*_scale_inv` tensors: dequantise to bf16 first). Semantics match transformers: sigmoid scores, selection
by scores + e_score_correction_bias within the topk_group best of n_group groups, normalised top-k weights
times routed_scaling_factor, SwiGLU experts, drop-less. transformers has no auxiliary losses; the
aux-loss-free bias update rate is a training setting (imported as 0) and the sequence-wise loss coefficient
is read from DeepSeek's own `seq_aux` / `aux_loss_alpha` keys when present (else 0).
"""
from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Iterable

import torch

from parallel3d.models.hf_llama import DENSE_RULES
from parallel3d.models.hf_experts import HF_FUSED, OURS_EXPERTS, OURS_ROUTER, put_fused, split_experts, stack_experts
from parallel3d.checkpoint.store import CheckpointError

_ATTN = {"q_a_proj": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b_proj": "q_b_proj", "q_proj": "q_proj",
         "kv_a_proj": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b_proj": "kv_b_proj",
         "o_proj": "o_proj"}
_ATTN_BACK = {v: k for k, v in _ATTN.items()}
_OURS_ATTN = re.compile(r"layers\.(\d+)\.attn\.(\w+)\.weight")
_HF_ATTN = re.compile(r"model\.layers\.(\d+)\.self_attn\.(\w+)\.weight")
_HF_ROUTER = re.compile(r"model\.layers\.(\d+)\.mlp\.gate\.(weight|e_score_correction_bias)")
_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_SHARED = re.compile(r"layers\.(\d+)\.mlp\.shared_experts\.(gate|up|down)_proj\.weight")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.")


# ---- config -------------------------------------------------------------------------------------------------
def deepseek_config_to_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face DeepseekV3Config (config.json dict) -> ModelConfig field values."""
    if hf.get("model_type") != "deepseek_v3":
        raise CheckpointError(f"config.json has model_type {hf.get('model_type')!r}; this importer reads deepseek_v3")
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias"):
        raise CheckpointError("hidden_act other than silu / attention_bias=true are unsupported")
    if hf.get("quantization_config"):
        raise CheckpointError("quantised (FP8) DeepSeek checkpoint: dequantise it to bf16/fp32 before importing")
    rope = dict(hf.get("rope_parameters") or {})
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = dict(hf.get("rope_scaling") or {})
    if not scaling and rope.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if scaling:
        kind = scaling.pop("type", None) or scaling.get("rope_type")
        if kind != "yarn":
            raise CheckpointError(f"DeepSeek rope scaling {kind!r} is unsupported (yarn only)")
        scaling = {"rope_type": "yarn", **{k: v for k, v in scaling.items() if k != "rope_type" and v is not None}}
    heads = hf["num_attention_heads"]
    experts, groups = hf["n_routed_experts"], hf.get("n_group") or 1
    fields = dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                  num_heads=heads, num_kv_heads=heads, ffn_hidden_size=hf["intermediate_size"], rope_theta=theta,
                  rope_scaling=scaling or None, norm_eps=hf["rms_norm_eps"],
                  max_seq_len=hf.get("max_position_embeddings", 4096),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)), init_std=hf.get("initializer_range", 0.02),
                  num_experts=experts, moe_top_k=hf["num_experts_per_tok"],
                  moe_ffn_hidden_size=hf["moe_intermediate_size"], num_shared_experts=hf.get("n_shared_experts") or 0,
                  first_k_dense=min(hf.get("first_k_dense_replace") or 0, hf["num_hidden_layers"]),
                  router_score="sigmoid", router_norm_topk=bool(hf.get("norm_topk_prob", True)),
                  router_num_groups=groups, router_topk_groups=hf.get("topk_group") or groups,
                  routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                  attention_type="mla", q_lora_rank=hf.get("q_lora_rank") or 0, kv_lora_rank=hf["kv_lora_rank"],
                  qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                  v_head_dim=hf["v_head_dim"])
    if hf.get("seq_aux") and hf.get("aux_loss_alpha"):  # DeepSeek's own config.json keys (not transformers')
        fields["seq_aux_loss_coef"] = float(hf["aux_loss_alpha"])
    if hf.get("scoring_func", "sigmoid") != "sigmoid" or hf.get("topk_method", "noaux_tc") != "noaux_tc":
        raise CheckpointError(f"scoring_func={hf.get('scoring_func')!r} / topk_method={hf.get('topk_method')!r}: "
                              f"DeepSeek-V3 routes with sigmoid scores and noaux_tc (as transformers does)")
    return fields


def fields_to_deepseek_config(m: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig field values -> a DeepseekV3Config dict; refuses what DeepseekV3 cannot express."""
    experts = m.get("num_experts", 0)
    problems = [f"{k}={m.get(k)!r}" for k, ok in [
        ("attention_type", m.get("attention_type") == "mla"), ("capacity_factor", not m.get("capacity_factor")),
        ("router_score", not experts or m.get("router_score") == "sigmoid")] if not ok]
    if problems:
        raise CheckpointError(f"cannot export as DeepseekV3: {', '.join(problems)}")
    # a dense MLA model is a DeepseekV3 whose dense layers are all of them (the routing fields are unused)
    dense_layers = m.get("first_k_dense", 0) if experts else m["num_layers"]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m["rope_theta"]}
    if m.get("rope_scaling"):
        rope = {**m["rope_scaling"], "rope_theta": m["rope_theta"]}
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": m["vocab_size"],
            "hidden_size": m["hidden_size"], "num_hidden_layers": m["num_layers"],
            "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_heads"],
            "intermediate_size": m["ffn_hidden_size"], "moe_intermediate_size": m.get("moe_ffn_hidden_size") or
            m["ffn_hidden_size"], "n_routed_experts": max(experts, 1),
            "num_experts_per_tok": m["moe_top_k"] if experts else 1,
            "n_shared_experts": m.get("num_shared_experts", 0), "first_k_dense_replace": dense_layers,
            "norm_topk_prob": m.get("router_norm_topk", True),
            "n_group": m.get("router_num_groups", 1) if experts else 1,
            "topk_group": m.get("router_topk_groups", 1) if experts else 1,
            "routed_scaling_factor": m.get("routed_scaling_factor", 1.0),
            "q_lora_rank": m.get("q_lora_rank") or None, "kv_lora_rank": m["kv_lora_rank"],
            "qk_nope_head_dim": m["qk_nope_head_dim"], "qk_rope_head_dim": m["qk_rope_head_dim"],
            "v_head_dim": m["v_head_dim"], "rms_norm_eps": m["norm_eps"], "max_position_embeddings": m["max_seq_len"],
            "tie_word_embeddings": m["tie_embeddings"], "hidden_act": "silu", "initializer_range": m["init_std"],
            "attention_bias": False, "rope_interleave": True, "num_nextn_predict_layers": 0, "torch_dtype": "float32",
            "rope_theta": m["rope_theta"], "rope_parameters": rope}


# ---- tensors ------------------------------------------------------------------------------------------------
def rope_row_order(rows: int, d_rope: int, per: int) -> torch.Tensor:
    """Row permutation that de-interleaves the last d_rope rows of every block of `per` rows (rows % per == 0):
    new[j] = old[order[j]]. Its inverse (argsort) re-interleaves."""
    order = torch.arange(rows).view(-1, per)  # (blocks, per)
    tail = order[:, per - d_rope:]
    order[:, per - d_rope:] = torch.cat([tail[:, 0::2], tail[:, 1::2]], dim=1)
    return order.flatten()


class DeepseekV3Adapter:
    architecture = "DeepseekV3ForCausalLM"

    def __init__(self) -> None:
        self._fields: dict[str, Any] = {}  # the model whose tensors pass next (set by config_from_hf / _to_hf)
        self._interleaved = True

    def accepts_model(self, fields: dict[str, Any]) -> bool:
        return fields.get("attention_type") == "mla"

    def config_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        self._fields = deepseek_config_to_fields(hf_config)
        self._interleaved = bool(hf_config.get("rope_interleave", True))
        return self._fields

    def config_to_hf(self, fields: dict[str, Any]) -> dict[str, Any]:
        self._fields, self._interleaved = dict(fields), True
        return fields_to_deepseek_config(fields)

    def _rope_rows(self, proj: str, t: torch.Tensor, to_ours: bool) -> torch.Tensor:
        if not self._interleaved or proj not in ("q_b_proj", "q_proj", "kv_a_proj"):
            return t
        m = self._fields
        per = m["qk_nope_head_dim"] + m["qk_rope_head_dim"] if proj != "kv_a_proj" else t.shape[0]
        order = rope_row_order(t.shape[0], m["qk_rope_head_dim"], per)
        return t[order if to_ours else torch.argsort(order)].contiguous()

    def from_hf(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        experts: dict[tuple[int, str], dict[int, torch.Tensor]] = defaultdict(dict)
        if not self._fields:
            raise CheckpointError("DeepseekV3Adapter.from_hf needs config_from_hf first (the head layout)")
        layers = self._fields["num_layers"]
        for name, t in tensors:
            if name.endswith("_scale_inv"):
                raise CheckpointError(f"{name}: FP8 block-quantised checkpoint; dequantise it before importing")
            if (m := _HF_LAYER.match(name)) and int(m[1]) >= layers:
                continue  # multi-token-prediction layer (not implemented here)
            if m := _HF_ATTN.fullmatch(name):
                if m[2] not in _ATTN_BACK:
                    raise CheckpointError(f"unexpected tensor {name!r} in a DeepseekV3 checkpoint")
                proj = _ATTN_BACK[m[2]]
                out[f"layers.{m[1]}.attn.{proj}.weight"] = self._rope_rows(proj, t, to_ours=True)
            elif m := _HF_ROUTER.fullmatch(name):
                out[f"layers.{m[1]}.mlp.router.{'weight' if m[2] == 'weight' else 'expert_bias'}"] = t
            elif m := _HF_EXPERT.fullmatch(name):
                experts[(int(m[1]), m[3])][int(m[2])] = t
            elif m := HF_FUSED.fullmatch(name):
                put_fused(out, m, t)
            elif name.startswith("model.layers.") and ".mlp.shared_experts." in name:
                out[name[len("model."):]] = t
            else:
                try:
                    out[DENSE_RULES.from_hf(name)] = t
                except KeyError:
                    raise CheckpointError(f"unexpected tensor {name!r} in a DeepseekV3 checkpoint") from None
        stack_experts(out, experts)
        return out

    def to_hf(self, name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if m := _OURS_ATTN.fullmatch(name):
            return {f"model.layers.{m[1]}.self_attn.{_ATTN[m[2]]}.weight": self._rope_rows(m[2], t, to_ours=False)}
        if m := OURS_ROUTER.fullmatch(name):
            return {f"model.layers.{m[1]}.mlp.gate.{'weight' if m[2] == 'weight' else 'e_score_correction_bias'}": t}
        if m := OURS_EXPERTS.fullmatch(name):
            return split_experts(f"model.layers.{m[1]}.mlp.experts.{{e}}.{m[2]}.weight", t)
        if _SHARED.fullmatch(name):
            return {f"model.{name}": t}
        try:
            return {DENSE_RULES.to_hf(name): t}
        except KeyError:
            return {}  # buffers with no Hugging Face counterpart
