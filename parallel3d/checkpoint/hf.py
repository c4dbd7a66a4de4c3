"""Hugging Face Llama <-> parallel3d: pure name and config mapping, plus directory import/export.

parallel3d never imports `models`: configs travel as plain dicts of ModelConfig field values.

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

import json
import os
import re
from typing import Any, Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parallel3d.checkpoint.store import CheckpointError, CheckpointReader, write_metadata, write_shard_file
from parallel3d.params import full_slices

_RULES = [  # (our regex, HF template)
    (r"embed\.weight", "model.embed_tokens.weight"),
    (r"layers\.(\d+)\.attn_norm\.weight", "model.layers.{0}.input_layernorm.weight"),
    (r"layers\.(\d+)\.attn\.(q|k|v|o)_proj\.weight", "model.layers.{0}.self_attn.{1}_proj.weight"),
    (r"layers\.(\d+)\.mlp_norm\.weight", "model.layers.{0}.post_attention_layernorm.weight"),
    (r"layers\.(\d+)\.mlp\.(gate|up|down)_proj\.weight", "model.layers.{0}.mlp.{1}_proj.weight"),
    (r"norm\.weight", "model.norm.weight"),
    (r"lm_head\.weight", "lm_head.weight"),
]


def _translate(name: str, rules: list[tuple[str, str]]) -> str:
    for pattern, template in rules:
        m = re.fullmatch(pattern, name)
        if m:
            return template.format(*m.groups())
    raise KeyError(name)


def ours_to_hf_name(name: str) -> str:
    return _translate(name, _RULES)


def hf_to_ours_name(name: str) -> str:
    reverse = [(re.escape(t).replace(r"\{0\}", r"(\d+)").replace(r"\{1\}", r"(\w+?)"), p) for p, t in _RULES]
    for pattern, ours_pattern in reverse:
        m = re.fullmatch(pattern, name)
        if m:
            out = ours_pattern.replace(r"\.", ".")
            for g in m.groups():
                out = re.sub(r"\([^)]*\)", g, out, count=1)
            return out
    raise KeyError(name)


def hf_config_to_model_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face LlamaConfig (config.json dict) -> ModelConfig field values."""
    if hf.get("model_type", "llama") != "llama":
        raise CheckpointError(f"config.json has model_type {hf.get('model_type')!r}; this importer reads llama")
    rope = dict(hf.get("rope_parameters") or {})
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type") == "llama3" else None)
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise CheckpointError(f"head_dim={hf['head_dim']} differs from hidden_size/num_attention_heads; unsupported")
    fields = dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
                  num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                  ffn_hidden_size=hf["intermediate_size"], rope_theta=float(theta), norm_eps=hf["rms_norm_eps"],
                  max_seq_len=hf.get("max_position_embeddings", 2048),
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  init_std=hf.get("initializer_range", 0.02))
    if scaling:
        fields["rope_scaling"] = {k: scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                         "original_max_position_embeddings")}
    return fields


def model_fields_to_hf_config(m: dict[str, Any]) -> dict[str, Any]:
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m["vocab_size"],
           "hidden_size": m["hidden_size"], "num_hidden_layers": m["num_layers"],
           "num_attention_heads": m["num_heads"], "num_key_value_heads": m["num_kv_heads"],
           "intermediate_size": m["ffn_hidden_size"], "rms_norm_eps": m["norm_eps"],
           "max_position_embeddings": m["max_seq_len"], "tie_word_embeddings": m["tie_embeddings"],
           "hidden_act": "silu", "initializer_range": m.get("init_std", 0.02), "torch_dtype": "float32",
           "head_dim": m["hidden_size"] // m["num_heads"], "attention_bias": False, "mlp_bias": False,
           "rope_theta": m["rope_theta"]}
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m["rope_theta"]}
    if m.get("rope_scaling"):
        rope = {"rope_type": "llama3", "rope_theta": m["rope_theta"], **m["rope_scaling"]}
        cfg["rope_scaling"] = dict(rope)
    cfg["rope_parameters"] = rope
    return cfg


def iter_hf_tensors(hf_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a Hugging Face directory (one safetensors file, or sharded with an index)."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{hf_dir} holds neither model.safetensors nor model.safetensors.index.json")
    for name in files:
        path = os.path.join(hf_dir, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"shard {path} listed in the index is missing")
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def import_hf(hf_dir: str, out_dir: str, name_map=hf_to_ours_name, config_map=hf_config_to_model_fields
              ) -> dict[str, Any]:
    """Write a weights-only native checkpoint from a Hugging Face directory; returns the model fields."""
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{cfg_path} is missing")
    with open(cfg_path) as f:
        fields = config_map(json.load(f))
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for key, value in iter_hf_tensors(hf_dir):
        if key.endswith("rotary_emb.inv_freq"):
            continue
        ours = name_map(key)
        value = value.float()
        tensors[ours] = (value, tuple(value.shape), full_slices(value.shape))
    if fields.get("tie_embeddings"):
        tensors.pop("lm_head.weight", None)
    index = write_shard_file(out_dir, "weights-00000.safetensors", tensors)
    write_metadata(out_dir, index, step=0, model=fields, weights_only=True, layout=None)
    return fields


def write_hf_directory(tensors: Iterable[tuple[str, torch.Tensor]], config: dict[str, Any], out_dir: str,
                       max_shard_bytes: int = 2 << 30) -> None:
    """Write (HF name, tensor) pairs as safetensors shards of at most `max_shard_bytes` plus config.json.
    Tensors are consumed one at a time, so a caller that reads them lazily never holds the whole model."""
    os.makedirs(out_dir, exist_ok=True)
    weight_map: dict[str, str] = {}
    files: list[str] = []
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0

    def flush() -> None:
        nonlocal shard_bytes
        if shard:
            file = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, os.path.join(out_dir, file), metadata={"format": "pt"})
            files.append(file)
            weight_map.update({k: file for k in shard})
            shard.clear()
            shard_bytes = 0

    for hf_name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if shard and shard_bytes + nbytes > max_shard_bytes:
            flush()
        shard[hf_name] = t.contiguous()
        shard_bytes += nbytes
    flush()
    if len(files) == 1:
        os.replace(os.path.join(out_dir, files[0]), os.path.join(out_dir, "model.safetensors"))
    else:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def model_tensor_names(reader: CheckpointReader) -> list[str]:
    """Model weights of a checkpoint (optimizer state is stored under "optim.")."""
    return [n for n in reader.tensor_names if "." in n and not n.startswith("optim.")]


def export_hf(ckpt_dir: str, out_dir: str, name_map=ours_to_hf_name, config_map=model_fields_to_hf_config,
              max_shard_bytes: int = 2 << 30) -> None:
    """Write a Hugging Face directory, reading one tensor at a time (never the whole model in memory)."""
    reader = CheckpointReader(ckpt_dir)

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name in model_tensor_names(reader):
            try:
                hf_name = name_map(name)
            except KeyError:
                continue  # buffers with no Hugging Face counterpart
            yield hf_name, reader.read(name)
    write_hf_directory(tensors(), config_map(reader.meta["model"]), out_dir, max_shard_bytes)
