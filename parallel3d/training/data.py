"""Token files, the demo text and the layout-independent batch sampler (docs/architecture.md section 2.2,
docs/training.md). Text and tokenizers, what launch/prepare_data.py turns into token files: text.py.

Token files are 1-D NumPy `.npy` arrays of ids (uint16/uint32/int32/int64), read memory-mapped.
Sample i is the window tokens[i*seq_len : i*seq_len + seq_len + 1] (inputs and shifted targets), so
samples tile the file without overlap except the one shared boundary token.

The sampler makes the global batch at step s a function of (seed, step) only: an endless stream of
sample indices, one seeded permutation per epoch, read global_batch_size at a time. Any dp size and
microbatch count then sees the same sequences, which the parity tests rely on. Context-parallel splitting
of each sequence happens in `parallel3d.context_parallel`, not here.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import torch

TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")


class DataError(ValueError):
    """Bad data input; the message names the file and the sizes involved."""


def smallest_token_dtype(vocab_size: int) -> np.dtype:
    """The smallest allowed token dtype holding ids 0..vocab_size-1 (uint8 is not a token dtype)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32 if vocab_size <= 1 << 32 else np.int64)


SUBJECTS = ("the cat", "a dog", "the model", "my friend", "the parallel rank", "a small bird")
VERBS = ("sees", "likes", "computes", "follows", "sends", "reduces", "gathers")
OBJECTS = ("the gradient", "a red ball", "the tensor", "some tokens", "the pipeline", "a tree")


def synthetic_tokens(num_tokens: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """Deterministic, learnable demo data: byte-encoded sentences from a tiny grammar.

    Used when `data.path` is null (the tiny CPU demo): a small model's loss falls quickly from
    ln(vocab) because spelling and word order are predictable. ASCII only, so ids < 128; for a smaller
    vocabulary ids are folded modulo vocab_size (still learnable). Sentence by sentence, a subject, a
    verb and an object are drawn with rng.integers (`_sentences_one_by_one`); `_sentences_at_once` draws
    the same words in bulk (a dry run of an 8B model at 4,096 sequences of 8,192 asks for 34M tokens,
    which took the loop 4.4 s)."""
    rng = np.random.default_rng(seed)
    shortest = sum(min(map(len, words)) for words in (SUBJECTS, VERBS, OBJECTS)) + 4   # spaces, ". "
    tokens = _sentences_at_once(rng, num_tokens, num_tokens // shortest + 1)
    if tokens is None:
        tokens = _sentences_one_by_one(np.random.default_rng(seed), num_tokens)
    return (tokens.astype(np.int64) % vocab_size).astype(smallest_token_dtype(vocab_size))


def _sentence(s: int, v: int, o: int) -> bytes:
    return f"{SUBJECTS[s]} {VERBS[v]} {OBJECTS[o]}. ".encode("ascii")


def _sentences_one_by_one(rng: np.random.Generator, num_tokens: int) -> np.ndarray:
    out, total = [], 0
    while total < num_tokens:
        words = (rng.integers(len(SUBJECTS)), rng.integers(len(VERBS)), rng.integers(len(OBJECTS)))
        ids = np.frombuffer(_sentence(*words), dtype=np.uint8)
        out.append(ids)
        total += len(ids)
    return np.concatenate(out)[:num_tokens]


def _sentences_at_once(rng: np.random.Generator, num_tokens: int, sentences: int) -> Optional[np.ndarray]:
    """What _sentences_one_by_one gives, from `sentences` (enough) words drawn at once; None in the rare
    case where a draw the loop makes would be redrawn.

    rng.integers(k) below 2^32 maps the generator's next 32-bit word u to (u * k) >> 32 (Lemire's method;
    numpy's bounded integers), redrawing when the low 32 bits of u * k fall under (2^32 - k) mod k: for
    k = 6 or 7 about once in 10^9 draws. Its 32-bit words are the stream a bulk draw of uint32s gives."""
    bounds = np.array([len(SUBJECTS), len(VERBS), len(OBJECTS)], dtype=np.uint64)
    words = rng.integers(0, 2 ** 32, size=(sentences, 3), dtype=np.uint32).astype(np.uint64)
    scaled = words * bounds                                                       # (sentences, 3)
    picks = (scaled >> np.uint64(32)).astype(np.int64)
    table = [_sentence(s, v, o) for s in range(len(SUBJECTS)) for v in range(len(VERBS))
             for o in range(len(OBJECTS))]                                        # in the order of `which`
    sizes = np.array([len(t) for t in table])
    which = (picks[:, 0] * len(VERBS) + picks[:, 1]) * len(OBJECTS) + picks[:, 2]  # (sentences,)
    used = int(np.searchsorted(np.cumsum(sizes[which]), num_tokens)) + 1          # as many as the loop draws
    if (scaled[:used] & np.uint64(2 ** 32 - 1) < (2 ** 32 - bounds) % bounds).any():
        return None
    which, lengths = which[:used], sizes[which[:used]]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])                         # of each sentence in `table`
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])                      # of each drawn one in the output
    at = np.repeat(starts[which] - offsets, lengths) + np.arange(int(lengths.sum()))
    return np.frombuffer(b"".join(table), dtype=np.uint8)[at][:num_tokens]


class TokenDataset:
    """Samples of seq_len + 1 tokens from a memory-mapped 1-D token file."""

    def __init__(self, path: str, seq_len: int, vocab_size: Optional[int] = None) -> None:
        if not os.path.exists(path):
            raise DataError(f"token file {path!r} does not exist")
        try:
            tokens = np.load(path, mmap_mode="r", allow_pickle=False)
        except Exception as e:               # corrupt header, pickled object array, not .npy ...
            raise DataError(f"token file {path!r} is not a readable .npy array: {e}") from None
        self._init(tokens, seq_len, path, vocab_size)

    @classmethod
    def from_array(cls, tokens: np.ndarray, seq_len: int, name: str = "<array>",
                   vocab_size: Optional[int] = None) -> "TokenDataset":
        """An in-memory dataset (e.g. `synthetic_tokens`), checked like a file."""
        self = cls.__new__(cls)
        self._init(np.asarray(tokens), seq_len, name, vocab_size)
        return self

    def _init(self, tokens: np.ndarray, seq_len: int, name: str, vocab_size: Optional[int]) -> None:
        if seq_len < 1:
            raise DataError(f"seq_len must be >= 1, got {seq_len}")
        if tokens.ndim != 1:
            raise DataError(f"token file {name!r} must be a 1-D array of token ids, got shape {tokens.shape}")
        if tokens.dtype.name not in TOKEN_DTYPES:
            raise DataError(f"token file {name!r} has dtype {tokens.dtype.name}; expected one of "
                            f"{', '.join(TOKEN_DTYPES)}")
        if len(tokens) < seq_len + 1:
            raise DataError(f"token file {name!r} holds {len(tokens)} tokens, fewer than "
                            f"seq_len + 1 = {seq_len + 1} needed for one sample")
        if vocab_size is not None:               # chunked scan: out-of-range ids crash embeddings later
            for start in range(0, len(tokens), 1 << 24):
                chunk = np.asarray(tokens[start:start + (1 << 24)])
                lo, hi = int(chunk.min()), int(chunk.max())
                if lo < 0 or hi >= vocab_size:
                    raise DataError(f"token file {name!r} holds id {hi if hi >= vocab_size else lo} "
                                    f"outside the vocabulary [0, {vocab_size})")
        self.path, self.tokens, self.seq_len = name, tokens, seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(i) * self.seq_len
        return torch.from_numpy(np.array(self.tokens[start:start + self.seq_len + 1], dtype=np.int64))

    def gather(self, indices: Sequence[int]) -> torch.Tensor:
        """LongTensor (len(indices), seq_len + 1) of the given samples, in order."""
        if len(indices) == 0:
            return torch.zeros(0, self.seq_len + 1, dtype=torch.long)
        return torch.stack([self[i] for i in indices])


class BatchSampler:
    """Global and per-rank batches as a pure function of (seed, step), plus a resumable cursor.

    The stream of sample indices is epoch 0's permutation, then epoch 1's, ... (each seeded by
    (seed, epoch); `shuffle=False` gives 0..N-1 every epoch, for evaluation). The global batch at step s
    is stream positions [s*B, (s+1)*B). `local_batch` gives dp rank r the contiguous block
    [r*B/dp, (r+1)*B/dp) of that batch and cuts it, in order, into microbatches of micro_batch_size rows.
    """

    def __init__(self, dataset: TokenDataset, global_batch_size: int, seed: int, shuffle: bool = True) -> None:
        if global_batch_size < 1:
            raise DataError(f"global_batch_size must be >= 1, got {global_batch_size}")
        self.dataset, self.global_batch_size, self.seed = dataset, global_batch_size, seed
        self.shuffle = shuffle
        self._perm_cache: tuple[int, np.ndarray] | None = None   # (epoch, permutation)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            n = len(self.dataset)
            order = (np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle
                     else np.arange(n))
            self._perm_cache = (epoch, order)
        return self._perm_cache[1]

    def indices(self, step: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        """Sample indices of rows [start, stop) of the global batch at `step`."""
        stop = self.global_batch_size if stop is None else stop
        n, base = len(self.dataset), step * self.global_batch_size
        out = np.empty(stop - start, dtype=np.int64)
        for j, pos in enumerate(range(base + start, base + stop)):
            out[j] = self._epoch_order(pos // n)[pos % n]
        return out

    def global_batch(self, step: int) -> torch.Tensor:
        """LongTensor (global_batch_size, seq_len + 1): the same for every parallel layout."""
        return self.dataset.gather(self.indices(step))

    def local_batch(self, step: int, dp_rank: int, dp_size: int, num_microbatches: int,
                    micro_batch_size: int) -> list[torch.Tensor]:
        """This dp rank's microbatches at `step`: `num_microbatches` tensors (micro_batch_size, seq_len+1)."""
        if dp_size * num_microbatches * micro_batch_size != self.global_batch_size:
            raise DataError(f"dp_size*num_microbatches*micro_batch_size = {dp_size}*{num_microbatches}*"
                            f"{micro_batch_size} != global_batch_size {self.global_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} not in [0, {dp_size})")
        per_rank = self.global_batch_size // dp_size
        rows = self.dataset.gather(self.indices(step, dp_rank * per_rank, (dp_rank + 1) * per_rank))
        return list(rows.split(micro_batch_size))

    def state_dict(self, step: int) -> dict:
        """JSON-able position of a run about to read `step` (the sampler itself has no cursor: batches are a
        function of the step), plus what must match on resume."""
        n = len(self.dataset)
        return {"step": step, "epoch": step * self.global_batch_size // n,
                "position": step * self.global_batch_size, "seed": self.seed,
                "global_batch_size": self.global_batch_size, "num_samples": n, "shuffle": self.shuffle}

    def check_resume(self, state: dict) -> None:
        """Refuse to resume a stream saved with a different seed, batch size or dataset size, which would
        silently change the data."""
        mine = self.state_dict(0)
        for key in ("seed", "global_batch_size", "num_samples", "shuffle"):
            if key in state and state[key] != mine[key]:
                raise DataError(f"data state mismatch on resume: saved {key}={state[key]!r}, "
                                f"current {key}={mine[key]!r}")
