"""The attention kernels at every tile shape the launch table holds or the GPU tile sweep may time, under the
interpreter, against the fp64 reference.

The other parity tests run the interpreter's (16, 16) tile. The causal loop's split (unmasked key blocks,
then the diagonal's), the longest-first order and the document-block skipping are index arithmetic on
BLOCK_M and BLOCK_N, so a tile whose ratio or size no test ran could compute a wrong answer fast, and the
sweep (benchmarks/attention_tiles.py) would then land it in the table. Each (BLOCK_M, BLOCK_N) runs as every
kernel's tile (forward, dK/dV, dQ) on packed documents with a causal mask, GQA, a length that leaves a
ragged last block, and a ring block (queries later than the keys), with the pointer loads; tiles of 64 key
rows or more also with the TMA loads and dK/dV's key-rows form.
"""
import importlib
import sys
from pathlib import Path

import pytest
import torch

from parallel3d.kernels import _flash_common
from test_documents import check_documents_against_reference

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
attention_tiles = importlib.import_module("attention_tiles")

TILES = sorted({t[:2] for t in _flash_common.TILES_16BIT.values()}
               | {t[:2] for tiles in attention_tiles.CANDIDATES.values() for t in tiles})


def _docs(b: int, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    eos = (torch.rand(b, s, generator=g) < 0.02).long()
    return torch.cumsum(eos, 1) - eos  # (b, s) document ids, a few documents per row


@pytest.mark.skipif(not _flash_common.interpreting(), reason="runs the kernels under TRITON_INTERPRET=1")
@pytest.mark.parametrize("tile", TILES, ids=lambda t: f"{t[0]}x{t[1]}")
def test_kernels_at_tile(monkeypatch, tile):
    bm, bn = tile
    forms = [(False, False)] + ([(True, True)] if bn >= 64 else [])
    torch.manual_seed(0)
    b, s, hq, hk, d = 1, max(bm, bn) + 37, 2, 1, 8  # two or more blocks each way, the last ragged
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64, requires_grad=True) for h in (hq, hk, hk))
    doc = _docs(b, s, 1)
    monkeypatch.setattr(_flash_common, "INTERPRETER_TILES", (bm, bn, 4, 1))
    for tma, key_rows in forms:
        monkeypatch.setattr(_flash_common, "INTERPRETER_TMA", tma)
        monkeypatch.setattr(_flash_common, "INTERPRETER_KEY_ROWS", key_rows)
        for qs, ks in ((slice(0, s), slice(0, s)), (slice(s - bm - 3, s), slice(0, s - bn // 2))):
            check_documents_against_reference(q, k, v, doc, qs, ks, True)
