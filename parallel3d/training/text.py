"""Text into token files (launch/prepare_data.py): the byte and Hugging Face tokenizers, documents read from
text and JSONL files, and their tokenization with an end-of-document id after each (docs/training.md)."""
from __future__ import annotations

import json
import os
from typing import Callable, Optional, Sequence

import numpy as np

from parallel3d.training.data import DataError, smallest_token_dtype

class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; special tokens (e.g. "<eos>") get ids 256, 257, ...

    Without special tokens the end-of-document id is byte 0 (NUL, which never occurs in text), so the
    vocabulary stays at 256 — a power of two that every tensor-parallel degree divides (the tiny preset).
    """

    def __init__(self, special_tokens: Sequence[str] = ()) -> None:
        self.special_tokens = list(special_tokens)
        self.vocab_size = 256 + len(self.special_tokens)
        self.eos_id = self.token_id("<eos>") if "<eos>" in self.special_tokens else 0

    def token_id(self, token: str) -> int:
        return 256 + self.special_tokens.index(token)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) for i in ids if 0 < int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` through the `tokenizers` package (imported only when used)."""

    EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")

    def __init__(self, path: str, eos_token: Optional[str] = None) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError("a tokenizer.json needs the 'tokenizers' package (pip install tokenizers)") from None
        if not os.path.exists(path):
            raise DataError(f"tokenizer file {path!r} does not exist")
        self._tok = Tokenizer.from_file(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        names = [eos_token] if eos_token else list(self.EOS_CANDIDATES)
        ids = [self._tok.token_to_id(n) for n in names]
        found = [i for i in ids if i is not None]
        if not found:
            raise DataError(f"tokenizer {path!r} has no end-of-text token among {names}; pass one")
        self.eos_id = found[0]

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


def iter_documents(path: str, jsonl_key: str = "text"):
    """Yield documents: each line's `jsonl_key` for .jsonl/.json-lines files, else the whole file."""
    if not os.path.exists(path):
        raise DataError(f"input file {path!r} does not exist")
    if path.endswith((".jsonl", ".ndjson")):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: invalid JSON ({e})") from None
                if not isinstance(record, dict) or jsonl_key not in record:
                    raise DataError(f"{path}:{n}: no key {jsonl_key!r} in the JSON record")
                yield str(record[jsonl_key])
    else:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def tokenize_text_files(paths: Sequence[str], tokenizer, jsonl_key: str = "text",
                        on_document: Optional[Callable[[str], None]] = None) -> np.ndarray:
    """Tokenize documents from text / JSONL files into one 1-D array, eos after every document.

    The dtype is the smallest one that fits `tokenizer.vocab_size`. on_document(text) is called after
    each document (progress reporting)."""
    dtype = smallest_token_dtype(tokenizer.vocab_size)
    eos = np.asarray([tokenizer.eos_id], dtype=np.int64)
    parts = []
    for path in paths:
        for doc in iter_documents(path, jsonl_key):
            parts.append(np.concatenate([tokenizer.encode(doc), eos]))
            if on_document is not None:
                on_document(doc)
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype=dtype)
