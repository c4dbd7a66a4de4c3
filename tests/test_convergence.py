"""Lossy data-parallel communication still trains: each lossy mode against the exact run, on the built-in
demo text (data.path unset), a 2-rank world, the tiny model (hidden 32, 2 layers, vocab 128, seq 32).

Measure: the fraction of the exact run's loss reduction the lossy run achieves,

    progress = (L0 - L_lossy) / (L0 - L_exact)       L = mean loss of the last 20 steps, L0 = the first loss

which, unlike a loss ratio, stays about constant as training goes on. Tolerances (README "Lossy
communication"), with what was measured at 150 steps (CI) and at 300 steps (`make sweep`, --full-sweep):

    mode                                          tolerance      measured (150 / 300 steps)
    powersgd, powersgd_rank=4                     progress >= 0.90         0.963 / 0.958
    topk, topk_ratio=0.1                          progress >= 0.85         0.936 / 0.873
    ZeRO-3 qwZ + qgZ, quant_block=64              |progress - 1| <= 0.01   1.000 / 1.001

A mode that lost its error feedback, or summed the compressed gradients wrongly, falls far below
(powersgd rank 1 / topk 0.01 already reach only ~0.80 / ~0.75 at 120 steps).
"""
from __future__ import annotations

import pytest

from ckpt_helpers import train

COMMON = ["model.vocab_size=128", "train.lr=3e-3", "train.warmup_steps=10", "train.global_batch_size=4"]
MODES = {
    "powersgd-r4": (["parallel.grad_compression=powersgd", "parallel.powersgd_rank=4"], 0.90, None),
    "topk-0.1": (["parallel.grad_compression=topk", "parallel.topk_ratio=0.1"], 0.85, None),
    "zero3-qwz-qgz": (["parallel.zero=3", "parallel.zero_quantized_weights=true",
                       "parallel.zero_quantized_gradients=true", "parallel.quant_block=64"], 0.99, 1.01),
}


@pytest.fixture(scope="module")
def steps(request):
    return 300 if request.config.getoption("--full-sweep") else 150


@pytest.fixture(scope="module")
def exact(worlds, steps):
    return worlds.run(2, train, [*COMMON, f"train.steps={steps}"], steps)[0]


def _progress(losses: list[float], exact: list[float]) -> float:
    tail = lambda xs: sum(xs[-20:]) / 20  # noqa: E731
    return (exact[0] - tail(losses)) / (exact[0] - tail(exact))


@pytest.mark.parametrize("mode", list(MODES))
def test_lossy_mode_converges_with_the_exact_run(worlds, exact, steps, mode):
    overrides, low, high = MODES[mode]
    losses = worlds.run(2, train, [*COMMON, f"train.steps={steps}", *overrides], steps)[0]
    assert losses[0] == pytest.approx(exact[0], rel=1e-3)   # the same run (compression starts later)
    progress = _progress(losses, exact)
    assert progress >= low, f"{mode}: {progress:.3f} of the exact run's loss reduction after {steps} steps"
    if high is not None:
        assert progress <= high, f"{mode}: {progress:.3f}"
    assert losses != exact   # it was really lossy
