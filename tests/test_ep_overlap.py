"""parallel.ep_overlap: a backward and another microbatch's forward run in turns, so each one's expert
all-to-alls travel while the other computes (issue 50 item 3; pipeline/pairing.py, interleave.py).

What must hold: the paired schedules are verified deadlock-free; the pair really alternates at the
all-to-alls; and the run is the world-size-1 run (loss, logged grad norm, weights after AdamW steps) on the
strict backend (NCCL's rules: outputs hidden until waited, issue order per group, no host read behind work in
flight), for 1F1B at pp 1 and 2, interleaved and DualPipe-V.
"""
from __future__ import annotations

import threading

import pytest
import torch

from parallel3d.interleave import Interleave
from parallel3d.pipeline.actions import ActionKind
from parallel3d.pipeline.pairing import check_ep_overlap, paired_schedule
from parallel3d.pipeline.placement import Schedule, placement_for
from parallel3d.pipeline.runtime_schedules import Pair, ScheduleCache
from parallel3d.pipeline.schedules import build_schedule
from parallel3d.pipeline.verify import verify
from parallel3d.training.config import ConfigError
from ckpt_helpers import build_trainer, context_for, make_config
from test_strict_backend import MOE, _train
from test_sweep import PARITY, check

K = ActionKind
GRID = [("1f1b", p, m, 1) for p in (1, 2, 3, 4) for m in (1, 2, 4, 5, 8)] + \
       [("interleaved", p, m, v) for p in (2, 4) for m in (4, 8) for v in (2, 3)] + \
       [("dualpipe-v", p, m, 2) for p in (1, 2, 4) for m in (8, 10)]


@pytest.mark.parametrize("name,p,m,v", GRID)
def test_paired_schedules_verify_and_pair_a_backward_with_another_microbatch(name, p, m, v):
    lists = build_schedule(name, p, m, v)
    new, pairs = paired_schedule(lists, move_messages=name != "interleaved")
    verify(Schedule(new, placement_for(lists)), p, m, v)
    for rank, (before, after) in enumerate(zip(lists, new)):
        assert sorted(map(repr, before)) == sorted(map(repr, after)), "pairing lost or added an action"
        for x, y in pairs[rank]:
            i = after.index(x)
            assert after[i + 1] == y and x.microbatch != y.microbatch
            assert {x.kind, y.kind} & {K.FORWARD} and {x.kind, y.kind} & {K.BACKWARD, K.BACKWARD_INPUT}
    if name == "1f1b" and m > 1:   # the steady state pairs: every backward but the last finds a forward
        assert len(pairs[-1]) == m - 1
    if name != "interleaved" and m >= 2 * p:
        assert all(pairs), pairs


def test_the_plan_runs_each_pair_as_one_step():
    cache = ScheduleCache()
    plan = cache.plan("1f1b", 1, 4, 1, 0, early=True, paired=True)
    kinds = [type(s).__name__ if isinstance(s, Pair) else s.kind.value for s in plan]
    assert kinds == ["F", "Pair", "Pair", "Pair", "B"]


def test_interleave_alternates_at_switch_points_and_keeps_thread_state():
    il, order = Interleave(), []

    def forward():
        for i in range(3):
            order.append(f"f{i}")
            il.switch()

    def backward():
        assert torch.is_grad_enabled() and threading.current_thread().name == "interleave-backward"
        for i in range(2):
            order.append(f"b{i}")
            il.switch()
    il.run(forward, backward)
    assert order == ["f0", "b0", "f1", "b1", "f2"]   # the backward finished: f2 runs on alone
    order.clear()
    il.run(forward, backward, first="backward")
    assert order == ["b0", "f0", "b1", "f1", "f2"]
    assert not il.active
    il.switch()   # outside a pair: nothing to hand over


def test_a_failing_side_stops_its_partner_and_raises_in_the_caller():
    il, seen = Interleave(), []

    def forward():
        seen.append("f")
        il.switch()
        seen.append("never")   # the backward failed: the forward stops at its switch

    def backward():
        raise RuntimeError("boom in backward")
    with pytest.raises(RuntimeError, match="boom in backward"):
        il.run(forward, backward)
    assert seen == ["f"] and not il.active


@pytest.mark.parametrize("schedule,zero,words", [
    ("gpipe", 0, "parallel.schedule in"), ("zb-v", 0, "parallel.schedule in"), ("1f1b", 3, "zero=3")])
def test_refusals_name_the_keys(schedule, zero, words):
    with pytest.raises(ValueError, match=words):
        check_ep_overlap(schedule, 2, zero)
    with pytest.raises(ValueError, match="parallel.ep > 1"):
        check_ep_overlap("1f1b", 1, 0)
    with pytest.raises(ConfigError, match="ep_overlap"):
        make_config(["parallel.ep_overlap=true", *MOE], 1)


# ---- through the Trainer, strict backend, against world size 1 --------------------------------------------

OVERLAP = ["parallel.ep_overlap=true", "train.micro_batch_size=1"]
CASES = {
    "1f1b-pp1-dp2-ep2": (2, ["parallel.dp=2", "parallel.ep=2", "train.global_batch_size=8", *MOE]),
    "1f1b-pp2-dp2-ep2-zero1": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero=1",
                                   "train.global_batch_size=8", *MOE]),
    "interleaved-pp2-dp2-ep2": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.schedule=interleaved",
                                    "parallel.virtual_stages=2", "model.num_layers=4", "train.global_batch_size=8",
                                    *MOE]),
    "dualpipe-v-pp2-dp2-ep2": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.schedule=dualpipe-v",
                                   "model.num_layers=4", "train.global_batch_size=8", *MOE]),
}


def _overlapped(worker, overrides, world):
    return _train(worker, [*overrides, *OVERLAP], world)


def _switches(worker, overrides):
    """The step's switch count: every paired microbatch's MoE all-to-alls hand the turn over."""
    cfg = make_config([*PARITY, "model.num_layers=2", *overrides, *OVERLAP], worker.world_size)
    ctx = context_for(cfg, worker, strict=True)
    trainer = build_trainer(cfg, ctx)
    trainer.train_step()
    return ctx.interleave.switches, list(ctx.stats.strict.reports)


@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_pairs_match_world_size_1_on_the_strict_backend(multirank, name):
    world, overrides = CASES[name]
    got = multirank(_overlapped, world, overrides, world)
    assert all(not g["reports"] for g in got), got[0]["reports"]
    ref = _train(None, [o for o in overrides if not o.startswith(("parallel.", "train.micro"))], world)
    check({"precision": "fp32"}, got, ref)


def test_the_pairs_hand_over_at_every_all_to_all(multirank):
    """pp1, 4 microbatches: 3 pairs; in each, the forward's 2 layers x (dispatch, combine) and the backward's
    2 layers x (combine', dispatch') switch while the partner is still running."""
    got = multirank(_switches, 2, ["parallel.dp=2", "parallel.ep=2", "train.global_batch_size=8", *MOE])
    for switches, reports in got:
        assert not reports
        assert switches == 3 * 8, switches
