"""Option-combination sweep through the real Trainer and DistributedOptimizer (issue: every option works).

Each case (tests/sweep_cases.py) trains 3 steps on 4 gloo ranks and at world size 1 from the same config. The
4 ranks run on the strict test backend (parallel3d/comm/strict.py), so a read of a collective's output before
its wait sees NaN, gloo takes NCCL's paths, and a host read that NCCL would make wait behind work in flight
fails the case.
  fp32        loss rel 1e-5 per step, every rank's logged grad_norm rel 1e-4 per step (clipping and Adam
              cancel a uniform gradient scale in the weights; tests/parity.py), weights after the 3 AdamW
              steps rtol 1e-4 (atol 1e-5; tests/parity.py)
  bf16, fp16  vs world size 1 of the same precision: loss rel LOW_PRECISION_LOSS_RTOL and grad_norm rel
              LOW_PRECISION_NORM_RTOL per step, weights
              fp32 master weights atol LOW_PRECISION_WEIGHT_ATOL and mean |diff| < LOW_PRECISION_WEIGHT_MEAN
              per tensor (16-bit activations summed in another order move a gradient by a few bf16 ulps,
              and Adam's first steps are nearly sign(g): an element with a tiny gradient can move by lr);
              and vs the fp32 run: loss rel TO_FP32_LOSS_RTOL.
Unsupported combinations must be refused by config validation (with a message naming them), never crash.

Cases with clip=0 train without gradient clipping. test_doubled_gradients_fail_the_check proves the check
fails when every gradient is doubled (a mutant the losses and the clipped AdamW weights cannot see).
CI runs the pairwise-covering subset; `make sweep` (pytest --full-sweep) runs the full product.
"""
from __future__ import annotations

import pytest
import torch

import sweep_cases as sc
from ckpt_helpers import build_trainer, context_for, make_config
from parallel3d.training.config import ConfigError
from parity import NORM_RTOL, WEIGHT_ATOL, assemble, assert_close_dicts, assert_grad_norms, double_every_gradient

LOW_PRECISION_LOSS_RTOL = 2e-3
LOW_PRECISION_NORM_RTOL = 1e-2          # a sum of squares of 16-bit-computed gradients, fp32 master copies
LOW_PRECISION_WEIGHT_ATOL = 2 * 3e-3    # two steps of lr: a near-zero gradient may flip Adam's sign
LOW_PRECISION_WEIGHT_MEAN = 1e-4        # ... but on average the weights agree far closer
TO_FP32_LOSS_RTOL = 2e-2
PARITY = ["train.lr=3e-3", "train.eps=1e-4", "train.warmup_steps=0", "train.lr_schedule=constant",
          "train.grad_clip=1.0"]  # a case's own train.grad_clip (sweep_cases.overrides) comes later and wins
STEPS = 3

# Combinations refused up front, with the words their message must contain (README: "Not supported").
UNSUPPORTED = [
    (lambda c: c["schedule"] == "zb-h1" and c["zero"] == 3, "zb-h1"),
    (lambda c: c["schedule"] in ("zb-v", "dualpipe-v") and c["zero"] == 3, "ZeRO-3.*split"),
]


def refusal(case: dict):
    return next((words for rule, words in UNSUPPORTED if rule(case)), None)


def run(worker, overrides: list[str]) -> dict:
    """The case's run; on 4 ranks on the strict backend (parallel3d/comm/strict.py: outputs NaN until waited,
    NCCL's paths, host reads that would wait behind work in flight reported)."""
    torch.set_num_threads(1)
    cfg = make_config([*PARITY, *overrides], 1 if worker is None else worker.world_size)
    ctx = context_for(cfg, worker, strict=True)
    trainer = build_trainer(cfg, ctx)
    records = [trainer.train_step() for _ in range(STEPS)]
    assert ctx.stats.strict is None or not ctx.stats.strict.reports, ctx.stats.strict.reports
    # the fp32 master weights: every element held by exactly one rank under any layout and ZeRO stage
    weights = {name.split("/", 1)[1]: (t.detach().clone(), slices, shape)
               for name, (t, shape, slices) in trainer.optimizer.state_tensors().items() if name.startswith("master/")}
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records], "weights": weights}


def _weights(parts: list[dict]) -> dict:
    return assemble(parts)


def pytest_generate_tests(metafunc):
    if "case" in metafunc.fixturenames:
        cases = list(sc.full_product()) if metafunc.config.getoption("full_sweep") else sc.pairwise()
        metafunc.parametrize("case", cases, ids=sc.name)


def test_pairwise_subset_covers_every_pair():
    cases = sc.pairwise()
    covered = set().union(*(sc._pairs(c) for c in cases))
    for a, b in __import__("itertools").combinations(sc.FACTORS, 2):
        for va in sc.FACTORS[a]:
            for vb in sc.FACTORS[b]:
                pair = tuple(sorted([(a, va), (b, vb)]))
                assert pair in covered, f"pair {pair} not covered"
    assert len(cases) < 60  # small enough for CI


def test_combination(worlds, case):
    overrides, layout = sc.overrides(case), sc.layout(case)
    words = refusal(case)
    if words is not None:
        with pytest.raises(ConfigError, match=words):
            make_config([*overrides, *layout], 4)
        return
    ref = run(None, sc.reference(case))
    got = worlds.run(4, run, [*overrides, *layout])
    check(case, got, ref)
    if case["precision"] != "fp32":
        fp32 = run(None, [o for o in sc.reference(case) if not o.startswith("train.precision")])
        assert got[0]["losses"] == pytest.approx(fp32["losses"], rel=TO_FP32_LOSS_RTOL), (got[0]["losses"], fp32["losses"])


def check(case: dict, got: list[dict], ref: dict) -> None:
    """The sweep's comparison of every rank's run (`got`) with world size 1's (`ref`) at the case's precision."""
    losses = got[0]["losses"]
    weights, expected = _weights([g["weights"] for g in got]), _weights([ref["weights"]])
    if case["precision"] == "fp32":
        assert losses == pytest.approx(ref["losses"], rel=1e-5), (losses, ref["losses"])
        assert_grad_norms([g["norms"] for g in got], ref["norms"], NORM_RTOL, sc.name(case))
        assert_close_dicts(weights, expected, rtol=1e-4, atol=WEIGHT_ATOL, what="weights")
        return
    assert losses == pytest.approx(ref["losses"], rel=LOW_PRECISION_LOSS_RTOL), (losses, ref["losses"])
    assert_grad_norms([g["norms"] for g in got], ref["norms"], LOW_PRECISION_NORM_RTOL, sc.name(case))
    assert_close_dicts(weights, expected, rtol=0, atol=LOW_PRECISION_WEIGHT_ATOL, what="weights")
    for name, w in weights.items():
        mean = (w - expected[name]).abs().mean().item()
        assert mean < LOW_PRECISION_WEIGHT_MEAN, f"{name}: mean |diff| {mean:.2e} vs world size 1"


_MUTANT = dict(schedule="1f1b", zero=0, precision="fp32", dim="dp", tied=True, recompute="none", microbatches=2,
               clip=1.0)
MUTANT_CASES = [_MUTANT, dict(_MUTANT, clip=0.0), dict(_MUTANT, precision="bf16")]


@pytest.mark.parametrize("mutant_case", MUTANT_CASES, ids=sc.name)
def test_doubled_gradients_fail_the_check(monkeypatch, mutant_case):
    """Mutant: every gradient doubled at world size 1 (through the real Trainer and DistributedOptimizer),
    compared by the sweep's check with the clean world-size-1 run: the check must fail. With clipping on it
    fails on the grad norm (the losses and the weights do not see a uniform scale); without clipping Adam's
    eps lets the later losses see it too, so any of the checks may fail first."""
    case = mutant_case
    assert set(case) == set(sc.FACTORS)
    ref = run(None, sc.reference(case))
    double_every_gradient(monkeypatch)
    mutant = run(None, sc.reference(case))
    assert mutant["norms"][0] == pytest.approx(2 * ref["norms"][0], rel=1e-4)  # the mutant is live
    with pytest.raises(AssertionError, match="grad_norm" if case["clip"] else None):
        check(case, [mutant], ref)
