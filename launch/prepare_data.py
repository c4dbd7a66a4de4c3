"""Turn text or JSONL files into a 1-D NumPy token file for `data.path` (DESIGN.md section 3).

    python launch/prepare_data.py --input a.txt b.jsonl --out tokens.npy \
        [--tokenizer tokenizer.json] [--jsonl-key text] [--eval-fraction 0.05 --eval-out eval.npy]

A .jsonl / .ndjson file gives one document per line (the --jsonl-key field); any other file is one
document. An end-of-document token follows every document. Without --tokenizer the byte tokenizer is
used (vocab 256, eos = byte 0, matching the tiny preset). The dtype is the smallest token dtype that fits
the vocabulary. With --eval-fraction the last fraction of the tokens, cut at a document boundary when
possible, goes to --eval-out.
"""
from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):                # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from parallel3d.training.data import ByteTokenizer, DataError, HFTokenizer, tokenize_text_files


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="text or JSONL files")
    p.add_argument("--out", required=True, help="output .npy token file")
    p.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer.json (default: bytes)")
    p.add_argument("--eos-token", default=None, help="end-of-text token name for --tokenizer")
    p.add_argument("--special-tokens", nargs="*", default=[],
                   help="byte tokenizer only: extra tokens with ids 256, ...; '<eos>' becomes the eos id")
    p.add_argument("--jsonl-key", default="text", help="JSONL field holding the document text")
    p.add_argument("--eval-fraction", type=float, default=0.0, help="fraction of tokens held out")
    p.add_argument("--eval-out", default=None, help="output .npy for the held-out tokens")
    return p.parse_args(argv)


def split_eval(tokens: np.ndarray, fraction: float, eos_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Split off about the last `fraction` of tokens, cutting at the document boundary (just after an
    eos) nearest to the target so no document straddles train and eval; mid-document only when the
    data has no inner boundary."""
    cut = int(round(len(tokens) * (1.0 - fraction)))
    bounds = np.flatnonzero(tokens[:-1] == eos_id) + 1
    if len(bounds):
        cut = int(bounds[np.argmin(np.abs(bounds - cut))])
    return tokens[:cut], tokens[cut:]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not 0.0 <= args.eval_fraction < 1.0:
            raise DataError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
        if args.eval_fraction > 0 and not args.eval_out:
            raise DataError("--eval-fraction needs --eval-out")
        for path in args.input:
            if not os.path.isfile(path):
                raise DataError(f"input file {path!r} does not exist")
        tokenizer = (HFTokenizer(args.tokenizer, args.eos_token) if args.tokenizer
                     else ByteTokenizer(args.special_tokens))
        tokens = tokenize_text_files(args.input, tokenizer, args.jsonl_key)
        if len(tokens) == 0:
            raise DataError(f"no tokens in {args.input}")
        outputs = [(args.out, tokens)]
        if args.eval_fraction > 0:
            train, held = split_eval(tokens, args.eval_fraction, tokenizer.eos_id)
            outputs = [(args.out, train), (args.eval_out, held)]
        for path, array in outputs:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "wb") as f:        # exact path: np.save(str) would append .npy
                np.save(f, array)
            print(f"wrote {path}: {len(array)} tokens, dtype {array.dtype}, vocab {tokenizer.vocab_size}")
    except (DataError, OSError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
