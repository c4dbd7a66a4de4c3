"""Hugging Face <-> parallel3d checkpoints: the generic machinery. The mappings belong to the models.

parallel3d never imports `models`: each model family provides a `StateDictAdapter` (models/hf.py keeps the
registry, keyed by the Hugging Face `architectures` name), and this module reads and writes directories
through it. Configs travel as plain dicts of ModelConfig field values.

    import_hf(hf_dir, out_dir, adapter)     weights-only native checkpoint (+ the model fields)
    export_hf(ckpt_dir, out_dir, adapter)   a directory transformers loads, one tensor at a time
    write_hf_tokenizer(source, out_dir)     the tokenizer beside it, so AutoTokenizer loads the same directory
"""
from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any, Iterable, Iterator, Optional, Protocol, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from parallel3d.checkpoint.store import CheckpointError, CheckpointReader, write_metadata, write_shard_file
from parallel3d.params import full_slices


class StateDictAdapter(Protocol):
    """One model family's Hugging Face mapping (TorchTitan's state-dict adapter idea)."""
    architecture: str  # the Hugging Face `architectures[0]`, e.g. "LlamaForCausalLM"

    def accepts_model(self, fields: dict[str, Any]) -> bool:
        """Whether a native checkpoint with these model fields exports as this family."""

    def config_from_hf(self, hf_config: dict[str, Any]) -> dict[str, Any]:
        """config.json -> ModelConfig field values (CheckpointError for what the model cannot express)."""

    def config_to_hf(self, fields: dict[str, Any]) -> dict[str, Any]:
        """ModelConfig field values -> config.json (CheckpointError for what the family cannot express)."""

    def from_hf(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Hugging Face tensors -> our global tensors by name."""

    def to_hf(self, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """One of our global tensors -> its Hugging Face tensors ({} when it has no counterpart)."""


class NameRules:
    """Bidirectional renaming by (our regex, Hugging Face template) rules, e.g.
    (r"layers\.(\d+)\.attn_norm\.weight", "model.layers.{0}.input_layernorm.weight")."""

    def __init__(self, rules: Sequence[tuple[str, str]]) -> None:
        self.rules = list(rules)
        self.reverse = [(re.escape(t).replace(r"\{0\}", r"(\d+)").replace(r"\{1\}", r"(\w+?)"), p) for p, t in rules]

    def to_hf(self, name: str) -> str:
        for pattern, template in self.rules:
            m = re.fullmatch(pattern, name)
            if m:
                return template.format(*m.groups())
        raise KeyError(name)

    def from_hf(self, name: str) -> str:
        for pattern, ours_pattern in self.reverse:
            m = re.fullmatch(pattern, name)
            if m:
                out = ours_pattern.replace(r"\.", ".")
                for g in m.groups():
                    out = re.sub(r"\([^)]*\)", g, out, count=1)
                return out
        raise KeyError(name)


def read_hf_config(hf_dir: str) -> dict[str, Any]:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing: not a Hugging Face model directory")
    with open(path) as f:
        return json.load(f)


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


def import_hf(hf_dir: str, out_dir: str, adapter: StateDictAdapter) -> dict[str, Any]:
    """Write a weights-only native checkpoint from a Hugging Face directory; returns the model fields."""
    fields = adapter.config_from_hf(read_hf_config(hf_dir))
    ours = adapter.from_hf((k, v.float()) for k, v in iter_hf_tensors(hf_dir) if not k.endswith("rotary_emb.inv_freq"))
    if fields.get("tie_embeddings"):
        ours.pop("lm_head.weight", None)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {n: (t, tuple(t.shape), full_slices(t.shape)) for n, t in ours.items()}
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


def export_hf(ckpt_dir: str, out_dir: str, adapter: StateDictAdapter, max_shard_bytes: int = 2 << 30) -> None:
    """Write a Hugging Face directory, reading one tensor at a time (never the whole model in memory)."""
    reader = CheckpointReader(ckpt_dir)
    config = adapter.config_to_hf(reader.meta["model"])

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name in model_tensor_names(reader):
            yield from adapter.to_hf(name, reader.read(name)).items()
    write_hf_directory(tensors(), config, out_dir, max_shard_bytes)


# the files a Hugging Face tokenizer directory may hold (AutoTokenizer reads whichever are present)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")


def token_name(tokenizer_json: str, token_id: int) -> Optional[str]:
    """The text of token `token_id` in a tokenizer.json (added tokens first, then the model's vocabulary)."""
    with open(tokenizer_json) as f:
        spec = json.load(f)
    for added in spec.get("added_tokens", []):
        if added.get("id") == token_id:
            return added["content"]
    vocab = spec.get("model", {}).get("vocab", {})
    if isinstance(vocab, dict):
        return next((name for name, i in vocab.items() if i == token_id), None)
    return None


def write_hf_tokenizer(source: str, out_dir: str, eos_id: Optional[int] = None,
                       max_length: Optional[int] = None) -> None:
    """Put a Hugging Face tokenizer into an exported model directory so that
    `AutoTokenizer.from_pretrained(out_dir)` loads it and `generate` stops at its end-of-text token.

    `source`: a tokenizer.json file (the one prepare_data.py read) or a directory holding tokenizer files.
    A bare tokenizer.json gets a tokenizer_config.json (PreTrainedTokenizerFast, eos token `eos_id`);
    `eos_id` also goes into config.json as `eos_token_id` when the adapter did not set one."""
    if os.path.isdir(source):
        present = [f for f in TOKENIZER_FILES if os.path.isfile(os.path.join(source, f))]
        if not present:
            raise CheckpointError(f"tokenizer directory {source} holds none of {', '.join(TOKENIZER_FILES)}")
        for name in present:
            shutil.copyfile(os.path.join(source, name), os.path.join(out_dir, name))
    elif os.path.isfile(source):
        shutil.copyfile(source, os.path.join(out_dir, "tokenizer.json"))
    else:
        raise CheckpointError(f"tokenizer {source} does not exist (pass --tokenizer PATH: a tokenizer.json "
                              f"or a Hugging Face tokenizer directory)")
    config_path = os.path.join(out_dir, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        tok_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
        eos = token_name(os.path.join(out_dir, "tokenizer.json"), eos_id) if eos_id is not None else None
        if eos is not None:
            tok_config["eos_token"] = eos
        if max_length:
            tok_config["model_max_length"] = int(max_length)
        with open(config_path, "w") as f:
            json.dump(tok_config, f, indent=1)
    model_config = os.path.join(out_dir, "config.json")
    if eos_id is not None and os.path.isfile(model_config):
        with open(model_config) as f:
            config = json.load(f)
        if config.get("eos_token_id") is None:
            config["eos_token_id"] = int(eos_id)
            with open(model_config, "w") as f:
                json.dump(config, f, indent=1)
