"""Convert between Hugging Face and parallel3d checkpoints.

    python launch/convert_hf.py import --hf-dir D --out C    # C: native weights + a runnable C/config.yaml
    python launch/convert_hf.py export --ckpt C --out D [--tokenizer T]
        # D: loads with transformers (AutoModelForCausalLM / AutoTokenizer .from_pretrained(D))

export writes the tokenizer the training data was prepared with: the `tokenizer` recorded in the sidecar
(`<tokens>.meta.json`, written by prepare_data.py) of the checkpoint's data.path / data.paths, or --tokenizer
(a tokenizer.json or a Hugging Face tokenizer directory), which takes precedence. Data prepared with the
byte tokenizer has no Hugging Face tokenizer: the weights are exported alone, with a note.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import SimpleNamespace
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.checkpoint.store import CheckpointError  # noqa: E402
from parallel3d.training.config import ExperimentConfig, save_yaml  # noqa: E402
from parallel3d.training.data_sources import read_metadata, token_paths  # noqa: E402


def do_import(hf_dir: str, out: str) -> None:
    from parallel3d.models.hf import import_hf

    fields = import_hf(hf_dir, out)
    model = ModelConfig(**fields)
    model.validate()
    cfg = ExperimentConfig(model=model)
    cfg.train.seq_len = min(cfg.train.seq_len, model.max_seq_len)
    cfg.checkpoint.load_dir = out
    save_yaml(cfg, os.path.join(out, "config.yaml"))


def trained_tokenizer(ckpt_dir: str) -> tuple[Optional[str], Optional[int]]:
    """(tokenizer, eos id) from the sidecars of the token files the checkpoint's run trained on; the
    tokenizer is None when the run used the synthetic data or the byte tokenizer."""
    with open(os.path.join(ckpt_dir, "metadata.json")) as f:
        data = (json.load(f).get("config") or {}).get("data") or {}
    paths = token_paths(SimpleNamespace(path=data.get("path"), paths=data.get("paths")))
    found = {(m.get("tokenizer"), m.get("eos_id")) for m in map(read_metadata, paths) if m is not None}
    if len(found) > 1:
        raise ValueError(f"the token files {paths} were prepared with different tokenizers {sorted(map(str, found))}; "
                         f"pass --tokenizer")
    tokenizer, eos_id = found.pop() if found else (data.get("tokenizer"), data.get("eos_id"))
    if tokenizer is None or str(tokenizer).startswith("bytes"):
        return None, eos_id
    return tokenizer, eos_id


def do_export(ckpt: str, out: str, tokenizer: Optional[str] = None) -> None:
    from parallel3d.checkpoint.hf import write_hf_tokenizer
    from parallel3d.checkpoint.load import resolve_checkpoint_dir
    from parallel3d.models.hf import export_hf

    ckpt_dir = resolve_checkpoint_dir(ckpt)  # a save root follows its `latest`
    recorded, eos_id = trained_tokenizer(ckpt_dir)
    export_hf(ckpt_dir, out)
    source = tokenizer or recorded
    if source is None:
        print(f"note: no Hugging Face tokenizer recorded for {ckpt} (synthetic or byte-tokenized data); "
              f"exported the weights only (pass --tokenizer PATH to add one)")
        return
    with open(os.path.join(out, "config.json")) as f:
        max_length = json.load(f).get("max_position_embeddings")
    write_hf_tokenizer(source, out, eos_id, max_length)
    print(f"tokenizer: {source}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import")
    imp.add_argument("--hf-dir", required=True)
    imp.add_argument("--out", required=True)
    exp = sub.add_parser("export")
    exp.add_argument("--ckpt", required=True)
    exp.add_argument("--out", required=True)
    exp.add_argument("--tokenizer", default=None,
                     help="tokenizer.json or Hugging Face tokenizer directory to write beside the weights "
                          "(default: the one the training data was prepared with, from its .meta.json sidecar)")
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            do_import(args.hf_dir, args.out)
        else:
            do_export(args.ckpt, args.out, args.tokenizer)
    except (CheckpointError, ValueError, KeyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
