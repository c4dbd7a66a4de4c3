"""Convert between Hugging Face and parallel3d checkpoints.

    python launch/convert_hf.py import --hf-dir D --out C    # C: native weights + a runnable C/config.yaml
    python launch/convert_hf.py export --ckpt C --out D      # D: loads with transformers.from_pretrained
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.checkpoint.store import CheckpointError  # noqa: E402
from parallel3d.training.config import ExperimentConfig, save_yaml  # noqa: E402


def do_import(hf_dir: str, out: str) -> None:
    from parallel3d.models.hf import import_hf

    fields = import_hf(hf_dir, out)
    model = ModelConfig(**fields)
    model.validate()
    cfg = ExperimentConfig(model=model)
    cfg.train.seq_len = min(cfg.train.seq_len, model.max_seq_len)
    cfg.checkpoint.load_dir = out
    save_yaml(cfg, os.path.join(out, "config.yaml"))


def do_export(ckpt: str, out: str) -> None:
    from parallel3d.models.hf import export_hf
    from parallel3d.checkpoint.load import resolve_checkpoint_dir

    export_hf(resolve_checkpoint_dir(ckpt), out)  # a save root follows its `latest`


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import")
    imp.add_argument("--hf-dir", required=True)
    imp.add_argument("--out", required=True)
    exp = sub.add_parser("export")
    exp.add_argument("--ckpt", required=True)
    exp.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "import":
            do_import(args.hf_dir, args.out)
        else:
            do_export(args.ckpt, args.out)
    except (CheckpointError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
