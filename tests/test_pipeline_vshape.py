"""ZB-V and DualPipe-V: the V placement, the pure schedules (verifier, simulated bubble, activation memory)
and training parity with world size 1 through the real Trainer + DistributedOptimizer.

Facts asserted (F = I = W = 1, B = 2 per chunk; a chunk holds half a stage, so bubble *fractions* compare
directly with the one-chunk schedules at F = I = W = 1 per stage):
- both verify for p = 1..8 and m = 2p .. 4p + 3, and refuse m < 2p and v != 2;
- ZB-V: makespan 6m + p - 1, bubble (p - 1) / (6m + p - 1), strictly below ZB-H1's (p-1)/(3m+p-1)
  and 1F1B's; every rank holds at most 2p chunk activations (p stages: 1F1B's peak on rank 0);
- DualPipe-V with the runtime's lazy sends: the same bubble as ZB-V; at most 2p + 1 chunk activations
  (DualPipe's "PP + 1"). Under the strict rendezvous model (sends wait for their receive) it loses more:
  a full backward spans 2 units, so some messages have no instant at which both ranks are between
  computes and the sender waits (the verifier still proves it deadlock-free).
"""
from __future__ import annotations

from fractions import Fraction as Fr

import pytest

from parallel3d.pipeline import (ActionKind, Schedule, build_schedule, chunks_per_rank, holders_of_ends,
                                 locate, one_f_one_b, peak_in_flight, placement_of, simulate, stage_ids,
                                 verify, zb_h1)
from parallel3d.pipeline.runtime import forward_only_schedule

K = ActionKind
UNIT = {K.FORWARD: 1, K.BACKWARD: 2, K.BACKWARD_INPUT: 1, K.BACKWARD_WEIGHT: 1}
V = ("zb-v", "dualpipe-v")


def test_v_placement():
    assert placement_of("zb-v") == placement_of("DualPipe_V") == "v" and placement_of("zb-h1") == "loop"
    assert chunks_per_rank("zb-v", 1) == 2 and chunks_per_rank("interleaved", 3) == 3
    assert [stage_ids(r, 3, 2, "v") for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert [stage_ids(r, 2, 2) for r in range(2)] == [[0, 2], [1, 3]]
    for p in range(1, 6):
        for s in range(2 * p):
            r, c = locate(s, p, "v")
            assert stage_ids(r, p, 2, "v")[c] == s
    assert holders_of_ends(4, 2, "v") == [0] and holders_of_ends(4, 1) == [0, 3]
    with pytest.raises(ValueError, match="exactly two chunks"):
        stage_ids(0, 2, 3, "v")


@pytest.mark.parametrize("name", V)
def test_verifier_accepts_all_sizes(name):
    for p in range(1, 9):
        for m in sorted({2 * p, 2 * p + 1, 3 * p, 4 * p + 3}):
            sched = build_schedule(name, p, m, 2)
            assert isinstance(sched, Schedule) and sched.placement == "v"
            verify(sched, p, m, 2)
            evaluation = Schedule(forward_only_schedule(p, m, 2, "v"), "v")
            simulate(evaluation)  # the evaluation order cannot deadlock either


@pytest.mark.parametrize("name", V)
def test_argument_errors(name):
    with pytest.raises(ValueError, match="at least 2 \\* pp microbatches"):
        build_schedule(name, 4, 7, 2)
    with pytest.raises(ValueError, match="two model chunks per rank"):
        build_schedule(name, 2, 4)
    with pytest.raises(Exception, match="out of range|peer"):  # a V schedule read as loop-placed
        verify(list(build_schedule(name, 2, 4, 2)), 2, 4, 2)


@pytest.mark.parametrize("lazy", [False, True])
def test_zb_v_bubble_and_memory(lazy):
    for p in range(2, 8):
        for m in (2 * p, 2 * p + 1, 3 * p, 4 * p):
            sched = build_schedule("zb-v", p, m, 2)
            t = simulate(sched, UNIT, lazy_sends=lazy)
            assert t.makespan == 6 * m + p - 1, (p, m)
            assert t.bubble_fraction == Fr(p - 1, 6 * m + p - 1)
            h1 = simulate(zb_h1(p, m), UNIT).bubble_fraction
            base = simulate(one_f_one_b(p, m), UNIT).bubble_fraction
            assert t.bubble_fraction < h1 < base
            # peak activations: 2p half-stage chunks = p stages, what 1F1B holds on its first rank
            assert [peak_in_flight(s) for s in sched] == [2 * p] * p
            assert max(peak_in_flight(s, until_weight=True) for s in sched) == 2 * peak_in_flight(
                one_f_one_b(p, m)[0])


def test_bubble_p4_m8():
    """The issue's example: p=4, m=8, equal F/B/W costs."""
    zbv = simulate(build_schedule("zb-v", 4, 8, 2), UNIT, lazy_sends=True).bubble_fraction
    dual = simulate(build_schedule("dualpipe-v", 4, 8, 2), UNIT, lazy_sends=True).bubble_fraction
    h1 = simulate(zb_h1(4, 8), UNIT, lazy_sends=True).bubble_fraction
    f1b1 = simulate(one_f_one_b(4, 8), {K.FORWARD: 1, K.BACKWARD: 2}, lazy_sends=True).bubble_fraction
    assert (zbv, dual, h1, f1b1) == (Fr(3, 51), Fr(3, 51), Fr(3, 27), Fr(9, 33))


def test_dualpipe_v_bubble_and_memory():
    for p in range(2, 8):
        for m in (2 * p, 2 * p + 1, 3 * p, 4 * p):
            sched = build_schedule("dualpipe-v", p, m, 2)
            lazy = simulate(sched, UNIT, lazy_sends=True)
            assert lazy.bubble_fraction == Fr(p - 1, 6 * m + p - 1), (p, m)
            assert [peak_in_flight(s) for s in sched] == [2 * p + 1] * p
            kinds = {a.kind for s in sched for a in s}
            assert {K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT} <= kinds  # full and split backwards


def test_dualpipe_v_pairs_forward_with_backward_of_another_microbatch():
    """The main phase of DualPipe-V: each forward on one chunk is followed by a full backward on the
    other chunk, of a different microbatch."""
    p, m = 3, 9
    for acts in build_schedule("dualpipe-v", p, m, 2):
        compute = [a for a in acts if a.kind.is_compute]
        pairs = [(x, y) for x, y in zip(compute, compute[1:]) if x.kind is K.FORWARD and y.kind is K.BACKWARD]
        assert len(pairs) >= 2 * (m - 2 * p + 1)
        assert all(x.chunk != y.chunk and x.microbatch != y.microbatch for x, y in pairs)


def test_docstring_example_is_the_schedule():
    from parallel3d.pipeline import format_schedule, zb_v
    rows = format_schedule(zb_v(2, 4), comm=False).splitlines()
    for row in rows:
        assert row[:60].rsplit(" ", 1)[0] in zb_v.__doc__


def test_dualpipe_v_pair_hides_its_messages_in_the_simulated_gloo_plan():
    """The simulator prices the gloo runtime's plan (early receives; DualPipe-V's sends right after their
    compute): with pipeline messages costing half a forward, each pair's F output is posted the moment the
    F ends (it travels during the partner B) and the B's received gradient is posted before the F starts;
    the step is shorter than with the schedule's own groups, and free messages change nothing."""
    from test_pipeline_overlap import dualpipe_pairs

    msg = Fr(1, 2)
    costed = {**UNIT, K.SEND_ACT: msg, K.RECV_ACT: msg, K.SEND_GRAD: msg, K.RECV_GRAD: msg}
    for p, m in ((2, 8), (3, 9), (4, 16)):
        sched = build_schedule("dualpipe-v", p, m, 2)
        grouped = simulate(sched, costed, lazy_sends=True)
        receives = simulate(sched, costed, lazy_sends=True, early_receives=True)
        paired = simulate(sched, costed, lazy_sends=True, early_receives=True, early_sends=True)
        assert paired.makespan < receives.makespan < grouped.makespan, (p, m)
        free = [simulate(sched, UNIT, lazy_sends=True, **kw).makespan for kw in
                ({}, {"early_receives": True}, {"early_receives": True, "early_sends": True})]
        assert free == [6 * m + p - 1] * 3
        checked = 0
        for rank, acts in enumerate(sched):
            start = {e.action: e.start for e in paired.events[rank]}
            end = {e.action: e.end for e in paired.events[rank] if e.action.kind.is_compute}
            for f, b, sends, recvs in dualpipe_pairs(acts):
                assert all(start[a] == end[f] for a in sends), (p, rank, f, sends)
                assert all(start[a] <= start[f] for a in recvs), (p, rank, f, recvs)
                checked += len(sends) + len(recvs)
        assert checked > m - 2 * p, (p, checked)


def test_early_posting_needs_lazy_sends():
    with pytest.raises(ValueError, match="lazy_sends"):
        simulate(build_schedule("dualpipe-v", 2, 4, 2), UNIT, early_sends=True)
