"""benchmarks/fp8_step.py at its --tiny size on the CPU (the GPU session runs it at Llama-3 8B's layer shapes,
gpu_check.sh phase fp8_step): its logic and its table, and that gpu_check.sh parses."""
from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
fp8_step = importlib.import_module("fp8_step")


def test_tiny_run_compares_the_three_recipes(capsys):
    rows = fp8_step.main(["--tiny", "--steps", "1", "--warmup", "1", "--microbatches", "2"])
    assert [r["recipe"] for r in rows] == ["none", "tensorwise", "rowwise"]
    base, tw, rw = rows
    assert base["speedup"] == 1.0 and base["loss_diff"] == 0.0 and base["weight_casts_per_step"] == 0
    assert all(abs(r["losses"][0] - base["losses"][0]) < 0.05 for r in rows)  # same weights, same batch
    layers = tw["weight_casts_per_step"]       # once per step per fp8 weight (2 blocks x 7 linears)
    assert layers == 14 and rw["weight_casts_per_step"] == 2 * layers
    assert all(abs(r["loss_diff"]) < 0.05 * base["losses"][-1] and r["step_s"] > 0 for r in rows)
    out = capsys.readouterr().out
    assert "| tensorwise | 2 |" in out and "| bf16 | 2 |" in out


def test_gpu_check_script_parses_and_has_the_phase():
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks/gpu_check.sh")]).returncode == 0
    text = (ROOT / "benchmarks/gpu_check.sh").read_text()
    assert "phase fp8_step 90" in text and "benchmarks/fp8_step.py" in text
