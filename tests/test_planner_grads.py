"""ZeRO-2 under gradient accumulation in the dry run (issue 27 item 7): the buffers a bucket accumulates in
are reduced and freed in every backward, so the step's peak holds the rank's gradient shard plus the
buckets in flight whatever the number of microbatches, and the tracker files those buffers under
gradients wherever they are freed (they used to count as activations, which the planner then scaled by
the microbatches in flight)."""
from __future__ import annotations

import pytest

from ckpt_helpers import make_config
from parallel3d.planner.dryrun import run_role
from parallel3d.planner.estimate import plan
from parallel3d.planner.hardware import gpu
from test_planner import _stage_builder

H100 = gpu("h100")
DP = 8
SHAPE = ["model.hidden_size=256", "model.ffn_hidden_size=512", "model.vocab_size=1024", "model.num_heads=4",
         "model.num_kv_heads=4", "model.num_layers=4", "train.seq_len=128", "train.micro_batch_size=1",
         "parallel.bucket_size_mb=0.25", "train.precision=bf16"]


def _run(zero: int, microbatches: int, extra=()):
    cfg = make_config([*SHAPE, f"parallel.zero={zero}", f"train.global_batch_size={DP * microbatches}",
                       *extra], DP)
    return run_role(cfg, 0, _stage_builder, H100, 8)


def test_zero2_peak_does_not_grow_with_microbatches():
    runs = {m: _run(2, m) for m in (1, 2, 4)}
    shard = runs[1].model_state["grads"]          # the reduced shard the rank keeps: 4 bytes / param / DP
    full = _run(1, 4).model_state["grads"]        # ZeRO-1 keeps the whole buffer
    assert 0 < shard * DP <= 1.05 * full
    # from the second microbatch on the shard lives beside the next backward's buckets: 2 and 4 are equal
    # (the activations differ by a few per-microbatch scalars: the loss sums)
    assert runs[4].memory["grads"] == runs[2].memory["grads"]
    assert runs[4].memory["peak"] == pytest.approx(runs[2].memory["peak"], rel=1e-3)
    assert runs[4].memory["peak"] - runs[1].memory["peak"] <= shard + 1e-3 * runs[1].memory["peak"]
    # gradients at the peak are the shard plus buckets in flight, far below the full buffer
    assert shard <= runs[4].memory["grads"] < 0.5 * full
    # the activations at the peak are one microbatch's, whatever m (the buffers freed inside the step are
    # gradients: before, ZeRO-2's buckets counted as activations from the second microbatch on)
    for m, run in runs.items():
        assert run.memory["activations"] == pytest.approx(runs[1].memory["activations"], rel=0.01), (m, run.memory)

def test_plan_does_not_scale_gradients_by_microbatches_in_flight():
    """pp=2: the dry run keeps 2 microbatches in flight on stage 0 and the plan scales the activations to
    the real schedule's; gradients (the shard, the buckets in flight) stay as they are."""
    small, large = (plan(make_config([*SHAPE, "parallel.zero=2", "parallel.pp=2",
                                      f"train.global_batch_size={4 * m}"], 8), _stage_builder, H100, 8)
                    for m in (4, 16))
    assert small.memory["grads"] == large.memory["grads"] > 0
