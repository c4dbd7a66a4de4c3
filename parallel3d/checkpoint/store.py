"""The on-disk format: safetensors shards plus one `metadata.json`. Nothing is ever unpickled.

    DIR/metadata.json   {"format": "parallel3d/1", "step": ..., "model": {...}, "layout": {...},
                         "tensors": {name: {"global_shape": [...], "dtype": "float32",
                                            "shards": [{"file": F, "key": K, "slices": [[start, stop], ...]}]}},
                         "files": {F: {"sha256": ..., "bytes": ...}}, ...}
    DIR/F.safetensors   the shard tensors, keyed K

A tensor's shards tile its global shape (a slice list per shard), so a reader can assemble any sub-slice
a rank needs under a different layout, reading only the overlapping parts (`safe_open(...).get_slice`).
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

    tensors: name -> (local data covering exactly `slices` of the global tensor, global shape, slices).
    """
    payload, index = {}, {}
    for name, (data, global_shape, slices) in tensors.items():
        payload[name] = data.detach().to("cpu").contiguous()
        index[name] = {"global_shape": list(global_shape), "dtype": str(data.dtype).replace("torch.", ""),
                       "shards": [{"file": file_name, "key": name, "slices": slices_to_json(slices)}]}
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
            raise CheckpointError(f"{path} is corrupt: {e}") from e
        if self.meta.get("format") != FORMAT:
            raise CheckpointError(f"{path}: unknown format {self.meta.get('format')!r}, expected {FORMAT!r}")
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

    def global_shape(self, name: str) -> tuple[int, ...]:
        if name not in self.meta["tensors"]:
            raise CheckpointError(f"tensor {name!r} not found in {self.directory}")
        return tuple(self.meta["tensors"][name]["global_shape"])

    def read(self, name: str, slices: Optional[Sequence[slice]] = None) -> torch.Tensor:
        """The part `slices` of global tensor `name`, assembled from every overlapping shard."""
        shape = self.global_shape(name)
        entry = self.meta["tensors"][name]
        slices = tuple(slices) if slices is not None else tuple(slice(0, n) for n in shape)
        out = torch.empty([s.stop - s.start for s in slices], dtype=getattr(torch, entry["dtype"]))
        covered = 0
        for shard in entry["shards"]:
            ranges = [(a, b) for a, b in shard["slices"]]
            lo = [max(a, s.start) for (a, _), s in zip(ranges, slices)]
            hi = [min(b, s.stop) for (_, b), s in zip(ranges, slices)]
            if any(l >= h for l, h in zip(lo, hi)):
                continue
            path = self._file(shard["file"])
            try:
                with safe_open(path, framework="pt") as f:
                    part = f.get_slice(shard["key"])[tuple(slice(l - a, h - a) for l, h, (a, _) in zip(lo, hi, ranges))]
            except Exception as e:  # safetensors raises its own error types for damaged files
                raise CheckpointError(f"cannot read {shard['key']!r} from {path}: {e}") from e
            out[tuple(slice(l - s.start, h - s.start) for l, h, s in zip(lo, hi, slices))] = part
            covered += part.numel()
        if covered < out.numel():
            raise CheckpointError(f"tensor {name!r} in {self.directory}: shards cover {covered} of {out.numel()} "
                                  f"requested elements (a shard file is missing from the metadata)")
        return out


def load_model_weights(reader: CheckpointReader, model: torch.nn.Module) -> None:
    """Load every parameter's slice (by `p.meta`) from the checkpoint. Tied copies read their source."""
    from parallel3d.params import load_global_slice

    for name, p in model.named_parameters():
        meta = p.meta
        source = meta.extra.get("tied_to", name)
        if source not in reader.meta["tensors"] and name in reader.meta["tensors"]:
            source = name
        shape = reader.global_shape(source)
        if tuple(shape) != tuple(meta.global_shape):
            raise CheckpointError(f"{reader.directory}: tensor {source!r} has shape {tuple(shape)} but the model "
                                  f"expects {tuple(meta.global_shape)} (checkpoint of another model shape?)")
        with torch.no_grad():
            load_global_slice(p, reader.read(source, meta.slices))
