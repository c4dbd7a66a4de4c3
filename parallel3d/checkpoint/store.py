"""The on-disk format: safetensors shards plus one `metadata.json`. Nothing is ever unpickled.

    DIR/metadata.json   {"format": "parallel3d/1", "step": ..., "model": {...}, "layout": {...},
                         "tensors": {name: {"global_shape": [...], "dtype": "float32",
                                            "shards": [{"file": F, "key": K, "slices": [[start, stop], ...]}]}},
                         "files": {F: {"sha256": ..., "bytes": ...}}, ...}
    DIR/F.safetensors   the shard tensors, keyed K

A tensor's shards tile its global shape (a slice list per shard), so a reader can assemble any sub-slice
a rank needs under a different layout, reading only the overlapping parts (`safe_open(...).get_slice`).
One file may hold several shards of a tensor (a ZeRO rank's flat range of a parameter cut into boxes):
their keys are "<name>#<i>" (PIECE); readers only follow "key", so older checkpoints read the same way.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Iterable, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "parallel3d/1"
PIECE = "#"   # "name#2": a further shard of tensor `name` written by the same rank (its file key keeps the suffix)
METADATA = "metadata.json"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, truncated or does not fit the model; the message names the file."""


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def slices_to_json(slices: Sequence[slice]) -> list[list[int]]:
    return [[s.start, s.stop] for s in slices]


def write_shard_file(directory: str, file_name: str,
                     tensors: dict[str, tuple[torch.Tensor, Sequence[int], Sequence[slice]]]) -> dict[str, Any]:
    """Write one safetensors file; return its index entries {"tensors": {...}, "files": {...}}.

    tensors: key -> (local data covering exactly `slices` of the global tensor, global shape, slices); the
    key is the tensor's name, or "<name>#<i>" for a further shard of the same tensor (PIECE).
    """
    payload, index = {}, {}
    for key, (data, global_shape, slices) in tensors.items():
        payload[key] = data.detach().to("cpu").contiguous()
        name = key.split(PIECE, 1)[0]
        entry = index.setdefault(name, {"global_shape": list(global_shape),
                                        "dtype": str(data.dtype).replace("torch.", ""), "shards": []})
        entry["shards"].append({"file": file_name, "key": key, "slices": slices_to_json(slices)})
    path = os.path.join(directory, file_name)
    save_file(payload, path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())
    return {"tensors": index, "files": {file_name: {"sha256": sha256_file(path), "bytes": os.path.getsize(path)}}}


def merge_indices(parts: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Combine the entries written by several files/ranks into one metadata index."""
    tensors: dict[str, Any] = {}
    files: dict[str, Any] = {}
    for part in parts:
        files.update(part["files"])
        for name, entry in part["tensors"].items():
            if name in tensors:
                tensors[name]["shards"].extend(entry["shards"])
            else:
                tensors[name] = {**entry, "shards": list(entry["shards"])}
    return {"tensors": tensors, "files": files}


def write_metadata(directory: str, index: dict[str, Any], **fields: Any) -> None:
    meta = {"format": FORMAT, **fields, **index}
    tmp = os.path.join(directory, METADATA + ".tmp")
    with open(tmp, "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(directory, METADATA))


class CheckpointReader:
    """Reads any slice of any tensor of a checkpoint directory, verifying each file's checksum once."""

    def __init__(self, directory: str, verify: bool = True) -> None:
        self.directory, self.verify = directory, verify
        path = os.path.join(directory, METADATA)
        if not os.path.isdir(directory):
            raise CheckpointError(f"checkpoint directory {directory} does not exist")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: {directory} is not a complete parallel3d checkpoint")
        try:
            with open(path) as f:
                self.meta = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path} is corrupt or truncated: {e}") from e
        if not isinstance(self.meta, dict):
            raise CheckpointError(f"{path} is corrupt: expected a JSON object")
        if self.meta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: unknown format {self.meta.get('format')!r}, expected {FORMAT!r}")
        if not isinstance(self.meta.get("tensors"), dict) or not isinstance(self.meta.get("files"), dict):
            raise CheckpointError(f"{path} is corrupt: no 'tensors' / 'files' index")
        self._checked: set[str] = set()

    @property
    def tensor_names(self) -> list[str]:
        return list(self.meta["tensors"])

    def _file(self, name: str) -> str:
        path = os.path.join(self.directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"shard file {path} is missing")
        if self.verify and name not in self._checked:
            expected = self.meta["files"].get(name, {})
            if os.path.getsize(path) != expected.get("bytes", -1):
                raise CheckpointError(f"shard file {path} is truncated or altered: {os.path.getsize(path)} bytes, "
                                      f"expected {expected.get('bytes')}")
            if sha256_file(path) != expected.get("sha256"):
                raise CheckpointError(f"shard file {path} is corrupt: checksum mismatch")
            self._checked.add(name)
        return path

    def verified_file(self, file_name: str) -> str:
        """Path of a file listed in the metadata, after checking it exists with the recorded size and sha256."""
        return self._file(file_name)

    def global_shape(self, name: str) -> tuple[int, ...]:
        if name not in self.meta["tensors"]:
            raise CheckpointError(f"tensor {name!r} not found in {self.directory}")
        return tuple(self.meta["tensors"][name]["global_shape"])

    def _plan(self, name: str, slices: Optional[Sequence[slice]]) -> tuple[tuple[slice, ...], list]:
        """The requested slices and the (path, key, source box, destination box) parts covering them.

        Raises CheckpointError naming the file when a needed shard is missing or damaged, or when the shards
        do not cover the request. Shards with identical slices (replicas) are read once."""
        shape = self.global_shape(name)
        entry = self.meta["tensors"][name]
        slices = tuple(slices) if slices is not None else tuple(slice(0, n) for n in shape)
        if len(slices) != len(shape) or any(s.start < 0 or s.stop > n or s.start > s.stop
                                            for s, n in zip(slices, shape)):
            raise CheckpointError(f"tensor {name!r} in {self.directory}: requested slices {slices_to_json(slices)} "
                                  f"do not fit its global shape {list(shape)}")
        parts, seen, covered = [], set(), 0
        for shard in entry["shards"]:
            ranges = [(a, b) for a, b in shard["slices"]]
            if tuple(map(tuple, ranges)) in seen:
                continue
            lo = [max(a, s.start) for (a, _), s in zip(ranges, slices)]
            hi = [min(b, s.stop) for (_, b), s in zip(ranges, slices)]
            if any(l >= h for l, h in zip(lo, hi)):
                continue
            seen.add(tuple(map(tuple, ranges)))
            src = tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, ranges))
            dst = tuple(slice(l - s.start, h - s.start) for l, h, s in zip(lo, hi, slices))
            parts.append((self._file(shard["file"]), shard["key"], src, dst))
            n = 1
            for l, h in zip(lo, hi):
                n *= h - l
            covered += n
        want = 1
        for s in slices:
            want *= s.stop - s.start
        if covered > want:  # partially overlapping shards (replicas sharded differently): count exactly
            mask = torch.zeros([s.stop - s.start for s in slices], dtype=torch.bool)
            for *_, dst in parts:
                mask[dst] = True
            covered = int(mask.sum())
        if covered < want:
            raise CheckpointError(f"tensor {name!r} in {self.directory}: shards cover {covered} of {want} "
                                  f"requested elements (a shard file is missing from the metadata)")
        return slices, parts

    def check(self, name: str, slices: Optional[Sequence[slice]] = None) -> None:
        """Validate that `read(name, slices)` would succeed (files present, checksums, coverage), reading no data."""
        self._plan(name, slices)

    def read(self, name: str, slices: Optional[Sequence[slice]] = None) -> torch.Tensor:
        """The part `slices` of global tensor `name`, assembled from every overlapping shard."""
        slices, parts = self._plan(name, slices)
        dtype = getattr(torch, self.meta["tensors"][name]["dtype"])
        out = torch.empty([s.stop - s.start for s in slices], dtype=dtype)
        for path, key, src, dst in parts:
            try:
                with safe_open(path, framework="pt") as f:
                    part = f.get_slice(key)[src]
            except Exception as e:  # safetensors raises its own error types for damaged files
                raise CheckpointError(f"cannot read {key!r} from {path}: {e}") from e
            if tuple(part.shape) != tuple(d.stop - d.start for d in dst):
                raise CheckpointError(f"{path}: tensor {key!r} has shape {tuple(part.shape)}, which does not "
                                      f"match its slices in {METADATA}")
            out[dst] = part
        return out
