"""Token-file metadata (EOS id, tokenizer), weighted mixtures of token files, and packed-document settings.

Sidecar: prepare_data.py writes `<name>.meta.json` next to each token file `<name>.npy`:
    {"eos_id": 0, "tokenizer": "bytes", "vocab_size": 256, "num_tokens": 12345, "dtype": "uint16"}
`data.eos_id` defaults to the sidecar's (every source of a mixture must agree).

Mixture (`data.paths`): `[[0.7, a.npy], [0.3, b.npy]]` or `"a.npy:0.7,b.npy:0.3"`; weights are normalised.
The global batch at step s stays a pure function of (seed, step) (docs/architecture.md section 2.2): row j's source is drawn
from rng(seed, step) with the weights, and its sample is the source's own seeded epoch permutation read
at stream position s*B + j (positions taken by other sources are skipped). No cursor: resuming at a step
continues the stream exactly; the state records the sources and weights so a changed mixture is refused.
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional, Sequence

import numpy as np
import torch

from parallel3d.training.data import BatchSampler, DataError, TokenDataset


def metadata_path(token_path: str) -> str:
    """`tokens.npy` -> `tokens.meta.json` (the sidecar prepare_data writes)."""
    return os.path.splitext(token_path)[0] + ".meta.json"


def write_metadata(token_path: str, eos_id: int, tokenizer: str, vocab_size: int, tokens: np.ndarray) -> str:
    path = metadata_path(token_path)
    with open(path, "w") as f:
        json.dump({"eos_id": int(eos_id), "tokenizer": tokenizer, "vocab_size": int(vocab_size),
                   "num_tokens": int(len(tokens)), "dtype": tokens.dtype.name}, f)
        f.write("\n")
    return path


def read_metadata(token_path: str) -> Optional[dict]:
    """The sidecar of a token file, or None when there is none."""
    path = metadata_path(token_path)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"token metadata {path!r} is not readable JSON: {e}") from None
    if not isinstance(meta, dict):
        raise DataError(f"token metadata {path!r} must be a JSON object")
    return meta


def parse_mixture(spec: Any) -> list[tuple[float, str]]:
    """data.paths -> [(weight, path)] with weights summing to 1. Raises DataError naming the problem."""
    if isinstance(spec, str):
        items = []
        for part in (p.strip() for p in spec.split(",") if p.strip()):
            path, sep, weight = part.rpartition(":")
            if not sep:
                raise DataError(f"data.paths entry {part!r} must be PATH:WEIGHT (e.g. a.npy:0.7,b.npy:0.3)")
            items.append((weight, path))
    elif isinstance(spec, (list, tuple)):
        items = []
        for entry in spec:
            if not isinstance(entry, (list, tuple)) or len(entry) != 2:
                raise DataError(f"data.paths entry {entry!r} must be [WEIGHT, PATH] "
                                f"(e.g. [[0.7, a.npy], [0.3, b.npy]])")
            w, p = entry
            items.append((p, w) if isinstance(w, str) and not isinstance(p, str) else (w, p))
    else:
        raise DataError(f"data.paths must be a list [[weight, path], ...] or 'a.npy:0.7,b.npy:0.3', got {spec!r}")
    out = []
    for w, p in items:
        try:
            weight = float(w)
        except (TypeError, ValueError):
            raise DataError(f"data.paths: weight {w!r} of {p!r} is not a number") from None
        if not weight > 0 or not np.isfinite(weight):
            raise DataError(f"data.paths: weight of {p!r} must be > 0, got {w!r}")
        out.append((weight, str(p)))
    if not out:
        raise DataError("data.paths is empty")
    if len({p for _, p in out}) != len(out):
        raise DataError(f"data.paths names a file twice: {[p for _, p in out]}")
    total = sum(w for w, _ in out)
    return [(w / total, p) for w, p in out]


def token_paths(data) -> list[str]:
    """Every token file the data config reads for training (data.path or the mixture's sources)."""
    if data.paths is not None:
        return [p for _, p in parse_mixture(data.paths)]
    return [data.path] if data.path is not None else []


def resolve_documents(data, vocab_size: int) -> None:
    """Packed-document settings of the data config, resolved in place: reset_positions defaults to
    document_masking; eos_id (needed when either is on) defaults to the token files' sidecar."""
    if data.path is not None and data.paths is not None:
        raise ValueError("set data.path or data.paths (a mixture), not both")
    if data.paths is not None:
        parse_mixture(data.paths)
    if data.reset_positions is None:
        data.reset_positions = data.document_masking
    if not (data.document_masking or data.reset_positions):
        return
    if data.eos_id is None:
        found = {}
        for path in token_paths(data):
            meta = read_metadata(path) if os.path.isfile(path) else None
            if meta is not None and "eos_id" in meta:
                found[path] = int(meta["eos_id"])
        if len(set(found.values())) > 1:
            raise ValueError(f"the token files disagree on the EOS id ({found}); set data.eos_id")
        if not found:
            where = ", ".join(metadata_path(p) for p in token_paths(data)) or "none (no data.path)"
            raise ValueError(f"data.document_masking / data.reset_positions need the end-of-document id: set "
                             f"data.eos_id=ID (no token metadata with an eos_id found: {where}; "
                             f"launch/prepare_data.py writes it)")
        data.eos_id = next(iter(found.values()))
    if not 0 <= data.eos_id < vocab_size:
        raise ValueError(f"data.eos_id={data.eos_id} is outside the vocabulary [0, model.vocab_size={vocab_size})")


class MixtureDataset:
    """Several TokenDatasets behind one index space: index = offset of its source + sample index."""

    def __init__(self, sources: Sequence[TokenDataset], weights: Sequence[float]) -> None:
        if len({d.seq_len for d in sources}) != 1:
            raise DataError("mixture sources must share seq_len")
        self.sources, self.weights = list(sources), np.asarray(weights, dtype=np.float64)
        self.offsets = np.cumsum([0] + [len(d) for d in self.sources])
        self.seq_len = self.sources[0].seq_len
        self.path = ",".join(f"{d.path}:{w:g}" for d, w in zip(self.sources, self.weights))

    @classmethod
    def from_spec(cls, spec: Any, seq_len: int, vocab_size: Optional[int] = None) -> "MixtureDataset":
        pairs = parse_mixture(spec)
        return cls([TokenDataset(p, seq_len, vocab_size) for _, p in pairs], [w for w, _ in pairs])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> torch.Tensor:
        src = int(np.searchsorted(self.offsets, i, side="right") - 1)
        return self.sources[src][int(i) - int(self.offsets[src])]

    def gather(self, indices: Sequence[int]) -> torch.Tensor:
        if len(indices) == 0:
            return torch.zeros(0, self.seq_len + 1, dtype=torch.long)
        return torch.stack([self[i] for i in indices])


class MixtureSampler(BatchSampler):
    """BatchSampler over a MixtureDataset: row j of step s comes from source rng(seed, s).choice(weights)[j],
    sample = that source's epoch permutation (seeded by (seed, source, epoch)) at stream position s*B + j."""

    def __init__(self, dataset: MixtureDataset, global_batch_size: int, seed: int) -> None:
        super().__init__(dataset, global_batch_size, seed)
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def _source_order(self, src: int, epoch: int) -> np.ndarray:
        key = (src, epoch)
        if key not in self._orders:
            if len(self._orders) > 4 * len(self.dataset.sources):
                self._orders.clear()
            n = len(self.dataset.sources[src])
            self._orders[key] = np.random.default_rng([self.seed, 1 + src, epoch]).permutation(n)
        return self._orders[key]

    def indices(self, step: int, start: int = 0, stop: Optional[int] = None) -> np.ndarray:
        stop = self.global_batch_size if stop is None else stop
        ds = self.dataset
        choice = np.random.default_rng([self.seed, step, 0]).choice(len(ds.sources), self.global_batch_size,
                                                                    p=ds.weights)
        out = np.empty(stop - start, dtype=np.int64)
        for j in range(start, stop):
            src, pos = int(choice[j]), step * self.global_batch_size + j
            n = len(ds.sources[src])
            out[j - start] = ds.offsets[src] + self._source_order(src, pos // n)[pos % n]
        return out

    def state_dict(self, step: int) -> dict:
        state = super().state_dict(step)
        state["sources"] = [os.path.basename(d.path) for d in self.dataset.sources]
        state["weights"] = [float(w) for w in self.dataset.weights]
        return state

    def check_resume(self, state: dict) -> None:
        super().check_resume(state)
        mine = self.state_dict(0)
        for key in ("sources", "weights"):
            if key in state and state[key] != mine[key]:
                raise DataError(f"data mixture mismatch on resume: saved {key}={state[key]!r}, "
                                f"current {key}={mine[key]!r}")
