"""Write the configuration reference (docs/configuration.md) from the config dataclasses.

    python launch/config_doc.py > docs/configuration.md     # regenerate
    python launch/config_doc.py --check docs/configuration.md  # exit 1 when the file is stale

The library renders the sections it owns (parallel3d/training/docgen.py); the model section is
models.config.ModelConfig with its CHOICES registry, passed in here because the library never imports a model.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.models.config import CHOICES, ModelConfig  # noqa: E402
from parallel3d.training.docgen import render  # noqa: E402


def reference() -> str:
    return render(ModelConfig, CHOICES)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="configuration reference (markdown) from the config dataclasses")
    parser.add_argument("--check", metavar="PATH", help="compare with PATH instead of printing; exit 1 when stale")
    args = parser.parse_args(argv)
    text = reference()
    if args.check is None:
        sys.stdout.write(text)
        return 0
    with open(args.check) as f:
        if f.read() == text:
            return 0
    print(f"{args.check} is stale: run `python launch/config_doc.py > {args.check}`", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
