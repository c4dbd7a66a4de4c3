"""Turn text or JSONL files into a 1-D NumPy token file for `data.path` (walk-through: docs/getting-started.md).

    python launch/prepare_data.py --input a.txt 'shards/*.jsonl' --out tokens.npy \
        [--tokenizer tokenizer.json] [--jsonl-key text] [--eval-fraction 0.05 --eval-out eval.npy]
        [--progress auto|on|off]

A .jsonl / .ndjson file gives one document per line (the --jsonl-key field); any other file is one
document. An end-of-document token follows every document. Without --tokenizer the byte tokenizer is
used (vocab 256, eos = byte 0, matching the tiny preset). The dtype is the smallest token dtype that fits
the vocabulary. With --eval-fraction the last fraction of the tokens, cut at a document boundary when
possible, goes to --eval-out.

Inputs may be glob patterns (quoted so the shell leaves them; matches are read in sorted order). Next to
each token file a sidecar `<name>.meta.json` records the EOS id and the tokenizer (data_sources.py):
`data.document_masking=true` reads its `data.eos_id` from there. Progress (tqdm when installed, else a
line every 10%) is shown on stderr for inputs over 16 MiB (--progress on/off to force).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

if __package__ in (None, ""):                # run as a script: make the repo root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from parallel3d.training.data import DataError
from parallel3d.training.text import ByteTokenizer, HFTokenizer, tokenize_text_files
from parallel3d.training.data_sources import write_metadata

LARGE_INPUT_BYTES = 16 << 20  # --progress auto shows progress above this much input


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="text or JSONL files, or glob patterns")
    p.add_argument("--out", required=True, help="output .npy token file")
    p.add_argument("--tokenizer", default=None, help="Hugging Face tokenizer.json (default: bytes)")
    p.add_argument("--eos-token", default=None, help="end-of-text token name for --tokenizer")
    p.add_argument("--special-tokens", nargs="*", default=[],
                   help="byte tokenizer only: extra tokens with ids 256, ...; '<eos>' becomes the eos id")
    p.add_argument("--jsonl-key", default="text", help="JSONL field holding the document text")
    p.add_argument("--eval-fraction", type=float, default=0.0, help="fraction of tokens held out")
    p.add_argument("--eval-out", default=None, help="output .npy for the held-out tokens")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress on stderr (auto: for inputs over 16 MiB)")
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


def expand_inputs(patterns: list[str]) -> list[str]:
    """Paths and glob patterns -> files (a pattern matching nothing, or a missing file, is an error)."""
    files = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(p for p in glob.glob(pattern) if os.path.isfile(p))
            if not matches:
                raise DataError(f"input pattern {pattern!r} matches no file")
            files.extend(matches)
        elif not os.path.isfile(pattern):
            raise DataError(f"input file {pattern!r} does not exist")
        else:
            files.append(pattern)
    return files


class Progress:
    """Input bytes tokenized so far: tqdm when installed, else a line on stderr every 10%."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self._next, self._bar = max(total, 1), 0, enabled, 0.1, None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, unit="B", unit_scale=True, desc="tokenizing", file=sys.stderr)
            except ImportError:
                pass

    def __call__(self, text: str) -> None:
        if not self.enabled:
            return
        n = len(text.encode("utf-8", errors="replace"))
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.done / self.total >= self._next:
            print(f"tokenizing: {self.done / self.total:.0%} of {self.total / 2**20:.1f} MiB", file=sys.stderr,
                  flush=True)
            self._next = self.done / self.total + 0.1

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if not 0.0 <= args.eval_fraction < 1.0:
            raise DataError(f"--eval-fraction must be in [0, 1), got {args.eval_fraction}")
        if args.eval_fraction > 0 and not args.eval_out:
            raise DataError("--eval-fraction needs --eval-out")
        inputs = expand_inputs(args.input)
        tokenizer = (HFTokenizer(args.tokenizer, args.eos_token) if args.tokenizer
                     else ByteTokenizer(args.special_tokens))
        total = sum(os.path.getsize(p) for p in inputs)
        progress = Progress(total, args.progress == "on" or (args.progress == "auto" and total > LARGE_INPUT_BYTES))
        try:
            tokens = tokenize_text_files(inputs, tokenizer, args.jsonl_key, on_document=progress)
        finally:
            progress.close()
        if len(tokens) == 0:
            raise DataError(f"no tokens in {inputs}")
        # the tokenizer's absolute path: convert_hf.py export finds it from here, wherever it runs
        tokenizer_name = os.path.abspath(args.tokenizer) if args.tokenizer else ("bytes+" + ",".join(args.special_tokens) if args.special_tokens
                                            else "bytes")
        outputs = [(args.out, tokens)]
        if args.eval_fraction > 0:
            train, held = split_eval(tokens, args.eval_fraction, tokenizer.eos_id)
            outputs = [(args.out, train), (args.eval_out, held)]
        for path, array in outputs:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "wb") as f:        # exact path: np.save(str) would append .npy
                np.save(f, array)
            meta = write_metadata(path, tokenizer.eos_id, tokenizer_name, tokenizer.vocab_size, array)
            print(f"wrote {path}: {len(array)} tokens, dtype {array.dtype}, vocab {tokenizer.vocab_size}, "
                  f"eos {tokenizer.eos_id} ({meta})")
    except (DataError, OSError) as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
