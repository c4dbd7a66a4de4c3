"""benchmarks/attention_table.py's pure parts (the GPU command of issue 49 runs it where a GPU is lent):
the packed documents it times, the pairs its FLOPs count, and the ratio tables it prints."""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
attention_table = importlib.import_module("attention_table")


def test_documents_are_runs_of_bounded_length():
    doc = attention_table.documents(3, 1000, 64, seed=0)
    assert doc.shape == (3, 1000) and doc.dtype == torch.int32
    assert bool((doc[:, 1:] >= doc[:, :-1]).all())
    spans = attention_table.spans(doc)
    for row, row_spans in zip(doc.tolist(), spans):
        assert row_spans[0][0] == 0 and row_spans[-1][1] == 1000
        assert all(a < e and len(set(row[a:e])) == 1 for a, e in row_spans)
        assert all(16 <= e - a < 112 for a, e in row_spans[:-1])  # [mean / 4, 7 mean / 4); the last is cut
    assert attention_table.causal_pairs(4) == 10  # 1 + 2 + 3 + 4 visible pairs


def test_tables_divide_the_fastest_reference_by_ours():
    def impl(fwd, bwd):
        return dict(fwd=fwd, bwd=bwd, fwd_tf=1.0, bwd_tf=1.0, expanded=False, diff=0.0)
    rows = [{"kind": "causal", "shape": "b1 s8", "auto": "sdpa", "impls": {
        "ours": impl(2.0, 4.0), "sdpa-flash": impl(3.0, 5.0), "sdpa-cudnn": impl(1.0, 6.0)}}]
    text = attention_table.tables(rows)
    assert "| b1 s8 | 0.50 (sdpa-cudnn) / 1.25 (sdpa-flash) | 0.0e+00 |" in text


def test_tile_sweep_summary_sets_the_fastest_beside_the_tables_choice():
    """benchmarks/attention_tiles.py's summary: per head dim and kernel, the table's row (tile, pointer or
    TMA loads) and the fastest one timed, with table / fastest; failed candidates, and fast ones that compute
    something else than SDPA, are left out."""
    tiles = importlib.import_module("attention_tiles")
    rows = [dict(d=128, kernel="fwd", tile=(64, 32, 4, 3), tma=False, table=True, ms=2.0, x_sdpa=0.25, error=1e-3),
            dict(d=128, kernel="fwd", tile=(64, 64, 4, 3), tma=True, table=False, ms=1.0, x_sdpa=0.5, error=2e-3),
            dict(d=128, kernel="fwd", tile=(128, 64, 8, 3), tma=False, table=False, ms=0.5, x_sdpa=1.0, error=0.3),
            dict(d=128, kernel="fwd", tile=(128, 128, 8, 3), tma=False, table=False, failed="OutOfResources"),
            dict(d=128, kernel="dq", tile=(64, 16, 8, 2), tma=False, table=True, ms=3.0, x_sdpa=0.3, error=1e-3)]
    text = tiles.summary(rows)
    assert "| 128 | fwd | (64, 32, 4, 3) ptr | 2.000 | 0.25 | (64, 64, 4, 3) tma | 1.000 | 0.50 | 2.00x |" in text
    assert tiles.relative_error((torch.tensor([1.0, -4.1]),), (torch.tensor([1.0, -4.0]),)) == pytest.approx(0.025)
    assert "| 128 | dq | (64, 16, 8, 2) ptr | 3.000 | 0.30 | (64, 16, 8, 2) ptr | 3.000 | 0.30 | 1.00x |" in text
    assert "dkdv" not in text


def test_tile_sweep_runs_its_paths_on_a_tiny_cpu_shape(tmp_path, capsys, monkeypatch):
    """attention_tiles.py --cpu-tiny (the interpreter): every kernel gets its table row timed (pointer and
    TMA loads; dK/dV in both forms), the tables it patches are restored, and the summary lands in --out.
    Only the table's rows (no other candidates): each interpreted run takes about a second."""
    from parallel3d.kernels import _flash_common as common
    tiles = importlib.import_module("attention_tiles")
    monkeypatch.setattr(tiles, "CANDIDATES", {key: [] for key in tiles.CANDIDATES})
    before = (dict(common.TILES_16BIT), common.TMA_16BIT, common.KEY_ROWS_16BIT)
    out = tmp_path / "tiles.md"
    assert tiles.main(["--cpu-tiny", "--head-dims", "16", "--budget-s", "120", "--out", str(out)]) == 0
    assert (dict(common.TILES_16BIT), common.TMA_16BIT, common.KEY_ROWS_16BIT) == before
    printed = capsys.readouterr().out
    assert "WRONG" not in printed   # every candidate checked against SDPA's output and gradients
    for kernel in ("fwd ", "dq  "):
        assert printed.count(f"d16 {kernel} (") == 2   # pointer and TMA loads
    dkdv_tile = common.TILES_16BIT[("dkdv", 80, 64)]   # the CPU stands in as sm_80
    forms = tiles._forms("dkdv", dkdv_tile, False)
    assert printed.count("d16 dkdv (") == 2 * len(forms) and printed.count("key rows") == 2 * sum(forms)
    assert tiles._forms("dkdv", (32, 64, 8, 2), False) == (False, True)   # key rows only with >= 64 key rows
    assert tiles._forms("dkdv", (64, 32, 4, 2), False) == (False,)
    assert tiles._forms("fwd", (64, 64, 4, 3), True) == (False,)
    text = out.read_text()
    assert text.startswith("| d | kernel | table's choice |") and "| 16 | fwd | (" in text
