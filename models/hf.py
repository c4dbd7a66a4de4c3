"""Hugging Face import/export for every model family we train, by `architectures` name.

    import_hf(hf_dir, out_dir)   the adapter of config.json's architecture; returns ModelConfig fields
    export_hf(ckpt_dir, out_dir) the first adapter that accepts the checkpoint's model fields

A new family registers a `parallel3d.checkpoint.hf.StateDictAdapter` in ADAPTERS (order matters for export:
the first whose `accepts_model` is true writes the directory).
"""
from __future__ import annotations

from typing import Any

from parallel3d.models.hf_deepseek import DeepseekV3Adapter
from parallel3d.models.hf_llama import LlamaAdapter
from parallel3d.models.hf_mixtral import MixtralAdapter
from parallel3d.models.hf_qwen3 import Qwen2Adapter, Qwen3Adapter, Qwen3MoeAdapter
from parallel3d.checkpoint import hf as hf_io
from parallel3d.checkpoint.hf import StateDictAdapter
from parallel3d.checkpoint.store import CheckpointError, CheckpointReader

# DeepSeek and Qwen first: Llama and Mixtral accept any dense / MoE model and would drop MLA, QK-norm weights
# and biases.
ADAPTERS: list[StateDictAdapter] = [DeepseekV3Adapter(), Qwen3MoeAdapter(), Qwen3Adapter(), Qwen2Adapter(),
                                    MixtralAdapter(), LlamaAdapter()]


def adapter_for_hf(hf_config: dict[str, Any]) -> StateDictAdapter:
    names = list(hf_config.get("architectures") or [])
    by_type = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
    if not names and hf_config.get("model_type") in by_type:  # old configs without `architectures`
        names = [by_type[hf_config["model_type"]]]
    for adapter in ADAPTERS:
        if adapter.architecture in names:
            return adapter
    known = ", ".join(a.architecture for a in ADAPTERS)
    raise CheckpointError(f"config.json architectures {names or None} (model_type {hf_config.get('model_type')!r}): "
                          f"no importer; supported: {known}")


def adapter_for_model(fields: dict[str, Any]) -> StateDictAdapter:
    for adapter in ADAPTERS:
        if adapter.accepts_model(fields):
            return adapter
    raise CheckpointError("no Hugging Face family can express this model")


def import_hf(hf_dir: str, out_dir: str) -> dict[str, Any]:
    """A weights-only native checkpoint of a Hugging Face directory; returns the ModelConfig fields."""
    return hf_io.import_hf(hf_dir, out_dir, adapter_for_hf(hf_io.read_hf_config(hf_dir)))


def export_hf(ckpt_dir: str, out_dir: str, max_shard_bytes: int = 2 << 30) -> None:
    """A directory `transformers` loads, from a native checkpoint (one tensor in memory at a time)."""
    fields = CheckpointReader(ckpt_dir, verify=False).meta["model"]
    hf_io.export_hf(ckpt_dir, out_dir, adapter_for_model(fields), max_shard_bytes)
