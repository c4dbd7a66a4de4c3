"""Random-number-generator state as JSON (torch CPU/CUDA, NumPy, Python `random`), never pickle.

Exact resume under the same layout restores every rank's generators bit for bit. Under a different layout
the per-rank streams have no meaning (rank r of the new layout is not rank r of the old), so each rank is
reseeded deterministically from (seed, step, rank) instead: reproducible, and different per rank.
"""
from __future__ import annotations

import base64
import hashlib
import random
from typing import Any

import numpy as np
import torch


def capture_rng(device: torch.device) -> dict[str, Any]:
    """This process's generator states as a JSON-able dict."""
    np_state = np.random.get_state()
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": {"kind": np_state[0], "keys": np_state[1].tolist(), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached_gaussian": float(np_state[4])},
        "python": {"version": py_version, "internal": list(py_internal), "gauss_next": py_gauss},
    }
    if device.type == "cuda" and torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return state


def restore_rng(state: dict[str, Any], device: torch.device) -> None:
    """Inverse of `capture_rng` (KeyError / ValueError on a malformed state; the caller names the file)."""
    raw = np.frombuffer(base64.b64decode(state["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if "cuda" in state and device.type == "cuda" and torch.cuda.is_available():
        raw = np.frombuffer(base64.b64decode(state["cuda"]), dtype=np.uint8).copy()
        torch.cuda.set_rng_state(torch.from_numpy(raw), device)


def reseed_rng(seed: int, step: int, rank: int, device: torch.device) -> None:
    """Deterministic fresh streams for a resume under a different layout."""
    digest = hashlib.sha256(f"rng:{seed}:{step}:{rank}".encode()).digest()
    value = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)
    torch.manual_seed(value)
    np.random.seed(value % (1 << 32))
    random.seed(value)
    if device.type == "cuda" and torch.cuda.is_available():
        torch.cuda.manual_seed(value)
