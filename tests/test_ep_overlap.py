"""parallel.ep_overlap: a backward and another microbatch's forward run in turns, so each one's expert
all-to-alls travel while the other computes (issue 50 item 3; pipeline/pairing.py, interleave.py).

What must hold: pairs are back-to-back computes of two microbatches (the schedule is unchanged); the pairs
really alternate at the all-to-alls; and the run is the world-size-1 run (loss, logged grad norm, weights
after AdamW steps) on the strict backend (NCCL's rules: outputs hidden until waited, issue order per group,
no host read behind work in flight), for 1F1B at pp 1, interleaved (ZeRO-1) and DualPipe-V at pp 2.
"""
from __future__ import annotations

import threading

import pytest
import torch

from parallel3d.interleave import Interleave
from parallel3d.pipeline.actions import ActionKind
from parallel3d.pipeline.pairing import check_ep_overlap, paired_schedule
from parallel3d.pipeline.runtime_schedules import Pair, ScheduleCache
from parallel3d.pipeline.schedules import build_schedule
from parallel3d.training.config import ConfigError
from ckpt_helpers import build_trainer, context_for, make_config
from test_strict_backend import MOE, _train
from test_sweep import PARITY, check

K = ActionKind
GRID = [("1f1b", 1, m, 1) for m in (1, 2, 5, 8)] + \
       [("interleaved", p, m, v) for p in (2, 4) for m in (4, 8) for v in (2, 3)] + \
       [("dualpipe-v", p, m, 2) for p in (1, 2, 4) for m in (8, 10)]


@pytest.mark.parametrize("name,p,m,v", GRID)
def test_pairs_are_back_to_back_forwards_and_backwards_of_two_microbatches(name, p, m, v):
    lists = build_schedule(name, p, m, v)
    pairs = paired_schedule(lists)
    for rank, actions in enumerate(lists):
        seen = set()
        for x, y in pairs[rank]:
            i = actions.index(x)
            assert actions[i + 1] == y and x.microbatch != y.microbatch
            assert {x.kind, y.kind} & {K.FORWARD} and {x.kind, y.kind} & {K.BACKWARD, K.BACKWARD_INPUT}
            assert not {x, y} & seen
            seen |= {x, y}
    if name == "1f1b":   # every backward but the last finds the next forward
        assert len(pairs[0]) == m - 1
    elif m >= 2 * p:   # a steady state on every rank
        assert all(pairs), pairs


def test_1f1b_under_pipelining_pairs_only_its_first_stage_and_is_refused():
    """Its steady state has a message group between every forward and backward but on stage 0 (which
    receives no activation); pairing across a group (its receives before the pair, its sends after) verifies
    but puts every hop behind a whole pair: the simulated step grows ~1.8x. So it is refused."""
    pairs = paired_schedule(build_schedule("1f1b", 4, 8))
    assert len(pairs[0]) == 4 and not any(pairs[1:])
    with pytest.raises(ValueError, match="use interleaved or dualpipe-v"):
        check_ep_overlap("1f1b", 2, 0, pp=2)


def test_the_plan_runs_each_pair_as_one_step():
    plan = ScheduleCache().plan("1f1b", 1, 4, 1, 0, early=True, paired=True)
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
    # the backward's recomputation exchanges (and switches) again, replaying the split sizes its forward read
    "1f1b-pp1-dp2-ep2-full-recompute": (2, ["parallel.dp=2", "parallel.ep=2", "train.global_batch_size=8",
                                            "train.activation_checkpointing=full", *MOE]),
    # the balancing statistics' blocking DP x CP all-reduce (its process group EP's at ep == dp) inside a pair
    # while the partner's rows are in flight: they run on EP's clone (ExpertExchange.async_group)
    "1f1b-pp1-dp2-ep2-zero2-zloss": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.zero=2",
                                         "train.global_batch_size=8", *MOE[:-1], "model.z_loss_coef=0.001"]),
    "interleaved-pp2-dp2-ep2-zero1": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero=1",
                                          "parallel.schedule=interleaved", "parallel.virtual_stages=2",
                                          "model.num_layers=4", "train.global_batch_size=8", *MOE]),
    "dualpipe-v-pp2-dp2-ep2": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.schedule=dualpipe-v",
                                   "model.num_layers=4", "train.global_batch_size=8", *MOE]),
}
SWEEP_CASES = {   # make sweep: the pairs beside TP/SP's and CP's own collectives, and activation offload
    "1f1b-tp2-sp-dp2-ep4-zero2": (4, ["parallel.tp=2", "parallel.sp=true", "parallel.dp=2", "parallel.ep=4",
                                      "parallel.zero=2", "train.global_batch_size=8", *MOE]),
    "1f1b-cp2-dp2-ep4-offload": (4, ["parallel.cp=2", "parallel.dp=2", "parallel.ep=4", "train.global_batch_size=8",
                                     "train.activation_offload=true", *MOE]),
}


def _overlapped(worker, overrides, world, strict=True, extra=OVERLAP):
    return _train(worker, [*overrides, *extra], world, strict=strict)


def matches_world_size_1(multirank, world: int, overrides: list, extra: list, strict: bool = True) -> None:
    """The layout (`overrides` + `extra`) on `world` gloo ranks against world size 1 (the same model and batch,
    no parallel.* key): loss, logged grad norm, weights after AdamW steps; on the strict backend no report."""
    got = multirank(_overlapped, world, overrides, world, strict, extra)
    assert all(not g["reports"] for g in got), got[0]["reports"]
    ref = _train(None, [o for o in overrides if not o.startswith(("parallel.", "train.micro"))], world)
    check({"precision": "fp32"}, got, ref)


def _switches(worker, overrides):
    """The step's switch count: every paired microbatch's MoE all-to-alls hand the turn over."""
    cfg = make_config([*PARITY, "model.num_layers=2", *overrides, *OVERLAP], worker.world_size)
    ctx = context_for(cfg, worker, strict=True)
    trainer = build_trainer(cfg, ctx)
    before = ctx.interleave.switches   # (the worker keeps its contexts across tests)
    trainer.train_step()
    return ctx.interleave.switches - before, list(ctx.stats.strict.reports)


@pytest.mark.parametrize("name", [*CASES, *(pytest.param(n, marks=pytest.mark.sweep) for n in SWEEP_CASES)])
def test_overlapped_pairs_match_world_size_1_on_the_strict_backend(multirank, name):
    matches_world_size_1(multirank, *{**CASES, **SWEEP_CASES}[name], OVERLAP)


def test_dualpipe_v_pairs_post_their_messages_early_on_plain_gloo(multirank):
    """On gloo (not the strict backend's NCCL paths) receives are posted a group early and DualPipe-V's sends
    right after the compute that made them: inside a pair, that group leaves as soon as the first compute is
    done (runtime_schedules.Pair.posts), while the partner finishes."""
    matches_world_size_1(multirank, *CASES["dualpipe-v-pp2-dp2-ep2"], OVERLAP, strict=False)
    plan = ScheduleCache().plan("dualpipe-v", 2, 4, 2, 0, early=True, paired=True)
    assert any(isinstance(s, Pair) and s.posts for s in plan)


def test_the_pairs_hand_over_at_every_all_to_all(multirank):
    """pp1, 4 microbatches: 3 pairs; in each, the forward's 2 layers x (dispatch, combine) and the backward's
    2 layers x (combine', dispatch') switch while the partner is still running."""
    got = multirank(_switches, 2, ["parallel.dp=2", "parallel.ep=2", "train.global_batch_size=8", *MOE])
    for switches, reports in got:
        assert not reports
        assert switches == 3 * 8, switches


# ---- the planner prices what the pairs hide ------------------------------------------------------------------

def test_the_dry_run_prices_a_pairs_all_to_alls_behind_its_partner():
    """The meta dry run runs the pairs too (the tracker follows the backward onto its thread): the paired
    instances' expert all-to-alls are started beside the partner's compute, so on an H100 their blocking part
    falls and nothing of them is exposed, while the work (FLOPs, ops, compute) is the unpaired run's."""
    from parallel3d.planner.dryrun import run_role
    from parallel3d.planner.hardware import gpu
    from test_planner import SMALL, _stage_builder
    runs = {}
    for overlap in ("false", "true"):
        cfg = make_config([*SMALL, *MOE, "parallel.dp=2", "parallel.ep=2", "train.micro_batch_size=1",
                           f"parallel.ep_overlap={overlap}"], 2)
        runs[overlap] = run_role(cfg, 0, _stage_builder, gpu("h100"), 8)
    off, on = runs["false"], runs["true"]
    assert on.flops == off.flops and not off.paired_actions
    for key, plain in off.actions.items():
        paired = on.paired_actions[key]
        assert paired.flops == plain.flops and abs(paired.ops - plain.ops) <= 2   # (an op at a turn's edge)
        assert paired.overlapped_comm_s > 0 and paired.exposed_comm_s == 0.0
        assert paired.blocking_comm_s < plain.blocking_comm_s
        assert paired.blocking_comm_s + paired.overlapped_comm_s == pytest.approx(plain.blocking_comm_s)
        assert on.actions[key].blocking_comm_s == pytest.approx(plain.blocking_comm_s)   # the unpaired F0, B7


def test_the_benchmark_reads_a_pairs_span_from_its_turns():
    """benchmarks/ep_overlap.py: a pair's span runs from its first turn's start to its last turn's end, set
    against the forward and backward measured apart."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "ep_overlap.py")
    spec = importlib.util.spec_from_file_location("ep_overlap_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    apart = {"step_s": 1.0, "rows": [("FORWARD", 0, 0.0, 2.0), ("BACKWARD", 0, 2.0, 5.0)]}
    # B0 then F1 in turns: B 10-11, F 11-12, B 12-13, F 13-14 (the unpaired F0 at 8-10 is left out)
    paired = {"step_s": 0.9, "rows": [("FORWARD", 0, 8.0, 10.0), ("BACKWARD", 0, 10.0, 11.0), ("FORWARD", 1, 11.0, 12.0),
                                      ("BACKWARD", 0, 12.0, 13.0), ("FORWARD", 1, 13.0, 14.0)]}
    row = bench.summarise(apart, paired)
    assert row["pairs"] == 1 and row["pair_span_s"] == 4.0 and row["ratio"] == pytest.approx(4.0 / 5.0)


def test_a_pairs_turns_add_up_to_each_actions_measured_cost():
    """log.timeline's simulated side takes each kind's mean measured cost: a paired action's turns (one row
    each) count as one action."""
    from parallel3d.pipeline.actions import Action
    from parallel3d.pipeline.timeline import mean_costs
    b0, f1, f0 = Action(K.BACKWARD, 0), Action(K.FORWARD, 1), Action(K.FORWARD, 0)
    rows = [(0, f0, 0.0, 2.0), (0, b0, 2.0, 3.0), (0, f1, 3.0, 4.0), (0, b0, 4.0, 6.0), (0, f1, 6.0, 9.0)]
    assert mean_costs(rows) == {(0, K.FORWARD): 3.0, (0, K.BACKWARD): 3.0}
