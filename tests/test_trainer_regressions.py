"""Options that passed their unit tests but failed through the real Trainer + DistributedOptimizer.

Each case runs the user's path (config -> Trainer -> DistributedOptimizer -> pipeline runtime) and compares
with the world-size-1 run of the same config: losses (rel 1e-5), every rank's logged grad_norm (rel 1e-4:
clipping, on by default, and Adam cancel a uniform gradient scale in the weights) and weights after the
optimizer steps (rtol 1e-4, atol 1e-5; see tests/parity.py for why Adam's eps is raised).
"""
from __future__ import annotations

import math

import pytest
import torch

from ckpt_helpers import build_trainer, context_for, make_config
from parity import WEIGHT_ATOL, assemble, assert_close_dicts, assert_grad_norms, double_every_gradient, local_slices

PARITY = ["train.lr=3e-3", "train.eps=1e-4", "train.warmup_steps=0", "train.lr_schedule=constant"]
MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "model.aux_loss_coef=0.5",
       "model.z_loss_coef=0.1"]


def run(worker, overrides, steps: int) -> dict:
    """Records of `steps` Trainer steps at the layout `overrides`, and this rank's weight slices."""
    torch.set_num_threads(1)
    cfg = make_config([*PARITY, *overrides], 1 if worker is None else worker.world_size)
    trainer = build_trainer(cfg, context_for(cfg, worker))
    records = [trainer.train_step() for _ in range(steps)]
    weights = {}
    for chunk in trainer.chunks:
        weights.update(local_slices(chunk, "data"))
    return {"records": records, "weights": weights, "scales": [r.get("loss_scale") for r in records]}


def assert_parity(got: list[dict], ref: dict) -> None:
    for r, (g, e) in enumerate(zip([x["loss"] for x in got[0]["records"]], [x["loss"] for x in ref["records"]])):
        assert abs(g - e) <= 1e-5 * abs(e), f"step {r}: loss {g} vs world size 1 {e}"
    assert_grad_norms([[x["grad_norm"] for x in rank["records"]] for rank in got],
                      [x["grad_norm"] for x in ref["records"]])
    weights, expected = assemble([x["weights"] for x in got]), assemble([ref["weights"]])
    if "lm_head.weight" in weights and "lm_head.weight" not in expected:  # the last stage's tied copy
        weights["embed.weight (tied copy)"] = weights.pop("lm_head.weight")
        expected["embed.weight (tied copy)"] = expected["embed.weight"]
    assert_close_dicts(weights, expected, rtol=1e-4, atol=WEIGHT_ATOL, what="weights")


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_doubled_gradients_fail_assert_parity(monkeypatch, clip):
    """Mutant: every gradient doubled at world size 1 through the real Trainer; assert_parity against the clean
    run must fail (with clipping, on the grad norm alone: losses and weights cannot see a uniform scale)."""
    layout = [f"train.grad_clip={clip}", "model.tie_embeddings=true"]
    ref = run(None, layout, 2)
    double_every_gradient(monkeypatch)
    mutant = run(None, layout, 2)
    with pytest.raises(AssertionError, match="grad_norm" if clip else None):
        assert_parity([mutant], ref)


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_zb_h1_through_trainer(worlds, zero):
    """ZB-H1's weight pass used to run one autograd call per parameter group; the optimizer took the first
    one's end for the end of the last microbatch and crashed ("arrived after its bucket was reduced")."""
    layout = ["parallel.pp=2", "parallel.schedule=zb-h1", f"parallel.zero={zero}", "model.num_layers=3",
              "train.global_batch_size=8", "train.micro_batch_size=1"]
    ref = run(None, layout[3:], 3)
    got = worlds.run(4 if zero else 2, run, layout, 3)
    assert_parity(got, ref)


def test_zb_h1_zero3_is_refused():
    from parallel3d.training.config import ConfigError
    with pytest.raises(ConfigError, match="zero=3.*zb-h1|zb-h1.*zero"):
        make_config(["parallel.pp=2", "parallel.schedule=zb-h1", "parallel.zero=3"], 4)


def test_zb_h1_moe_tied_through_trainer(worlds):
    # dp=1: the aux losses are computed over each global micro-batch, whose split changes with dp
    layout = ["parallel.pp=2", "parallel.schedule=zb-h1", "parallel.tp=2", "parallel.sp=true",
              "model.tie_embeddings=true", *MOE]
    ref = run(None, layout[4:], 3)
    assert_parity(worlds.run(4, run, layout, 3), ref)


def test_moe_pipeline_logged_loss_includes_every_stage_aux(worlds):
    """The logged loss is the objective: token loss plus every MoE layer's aux terms, whichever stage holds
    the layer. It used to leave out the aux losses of all stages but the last."""
    layout = ["parallel.pp=2", "model.num_layers=4", "train.global_batch_size=4", *MOE]
    ref = run(None, layout[1:], 2)
    no_aux = run(None, [*layout[1:], "model.aux_loss_coef=0", "model.z_loss_coef=0"], 1)
    first = ref["records"][0]["loss"]
    assert first - no_aux["records"][0]["loss"] > 1e-3, "the aux terms must be visible in the reference loss"
    got = worlds.run(2, run, layout, 2)
    for rank in got:  # the loss is all-reduced: every rank reports the objective
        assert [r["loss"] for r in rank["records"]] == pytest.approx([r["loss"] for r in ref["records"]], rel=1e-5)


def test_fp16_dynamic_scale_backs_off_and_recovers():
    """An initial scale far too large overflows the fp16 gradients. The scaler must halve the scale on
    every skipped step until the gradients are finite, then train (it used to skip every later step with
    the scale stuck at its initial value, since the skipped path never updated the scaler)."""
    steps = 24
    out = run(None, ["train.precision=fp16", f"train.initial_loss_scale={2.0 ** 40}", "train.loss_scale_window=1000"],
              steps)
    recs = out["records"]
    skipped = [r["skipped"] for r in recs]
    scales = [r["loss_scale"] for r in recs]
    assert skipped[0], "2**40 must overflow fp16 gradients (the test relies on it)"
    first_ok = skipped.index(False)
    assert not any(skipped[first_ok:]), f"after the scale settled no step may be skipped: {skipped}"
    # every skipped step halves the scale; the logged scale is the one after the step's update
    assert scales[:first_ok] == [2.0 ** (39 - i) for i in range(first_ok)]
    assert scales[first_ok:] == [scales[first_ok - 1]] * (steps - first_ok)
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in recs[first_ok:])


@pytest.mark.parametrize("split", ["[0, 3]", "[3, 0]"])
def test_empty_end_stage_from_the_command_line(worlds, split):
    """A first stage holding only the embedding (or a last one holding only the head) is a valid split
    (pipeline.partition owns the rule); config validation used to demand a layer on every stage."""
    layout = ["parallel.pp=2", f"parallel.layers_per_stage={split}", "model.num_layers=3"]
    ref = run(None, layout[2:], 2)
    assert_parity(worlds.run(2, run, layout, 2), ref)


def test_evaluate_reads_the_first_batches_of_the_file_in_order():
    """train.eval_steps=N evaluates the first N global batches of data.eval_path, unshuffled (the same rows at
    every evaluation of a run, and in every run): Trainer.evaluate(dataset, 1) is the loss of rows 0..B-1,
    by the world-size-1 model itself."""
    import numpy as np

    from doc_helpers import reference_model
    from parallel3d.training.data import TokenDataset
    cfg = make_config([], 1)
    trainer = build_trainer(cfg, context_for(cfg))
    b, s = cfg.train.global_batch_size, cfg.train.seq_len
    tokens = np.random.default_rng(5).integers(0, 128, size=4 * b * s + 1).astype(np.uint16)
    ds = TokenDataset.from_array(tokens, s)   # 4 global batches
    rows = ds.gather(range(b))   # (b, s+1): the file's first b windows
    with torch.no_grad():
        want = float(reference_model(cfg)(rows[:, :-1], torch.arange(s), rows[:, 1:])) / rows[:, 1:].numel()
    loss, count = trainer.evaluate(ds, 1)
    assert count == b * s and abs(loss - want) <= 1e-5 * want, (loss, want)
