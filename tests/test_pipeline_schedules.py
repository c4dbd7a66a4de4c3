"""Pure tests of pipeline schedules: verifier, simulator (bubble / memory facts), printer, plots.

Facts asserted (docs/parallelism.md, pipeline schedules), all exact with ``fractions.Fraction`` costs:
- GPipe and 1F1B, any m >= 1: bubble fraction = (p-1)/(m+p-1), with F=B=1 and with F=1, B=2.
- Interleaved 1F1B, v chunks, m % p == 0, chunk costs F=1/v, B=1/v or 2/v:
  bubble fraction = (p-1)/(v*m + p-1); idle time per rank = 1F1B's idle time / v.
- ZB-H1 with F=I=W=1 and m >= p: makespan = 3m + p - 1, bubble = (p-1)/(3m+p-1): idle time is
  exactly 1/3 of 1F1B's (F=1, B=2). The *fraction* is <= 0.4 x 1F1B's when m >= 3(p-1)
  (at m = 2p the ratio is (3p-1)/(7p-1), <= 0.4 only for p <= 3). For m < p it is still <= 1F1B's.
- Peak in-flight microbatches (forward done, input-grad not yet): 1F1B rank r min(p-r, m) (so
  min(p, m) on stage 0), GPipe m, ZB-H1 the same as 1F1B on every rank, and <= min(p, m) even
  counting until the weight gradient.
Each holds with blocking communication groups and with lazy (non-blocking) sends.
"""
from fractions import Fraction as Fr

import pytest

from parallel3d.pipeline import (Action, ActionKind, ScheduleError, Timeline, build_schedule,
                                 format_schedule, format_timeline, gpipe, interleaved_1f1b,
                                 one_f_one_b, peak_in_flight, plot_side_by_side, plot_timeline,
                                 simulate, verify, zb_h1)

K = ActionKind
PS = range(1, 9)


def ms(p: int) -> list[int]:
    return sorted({1, 2, max(1, p - 1), p, p + 1, 2 * p, 2 * p + 1, 3 * p})


def unit(f: int = 1, b: int = 1) -> dict:
    """Integer costs keep the simulator fast; Timeline.bubble_fraction is then an exact Fraction."""
    return {K.FORWARD: f, K.BACKWARD: b, K.BACKWARD_INPUT: 1, K.BACKWARD_WEIGHT: 1}


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_verifier_accepts_all_sizes(name):
    for p in PS:
        for m in ms(p):
            verify(build_schedule(name, p, m), p, m)


def test_verifier_accepts_interleaved():
    for p in PS:
        for v, m in [(2, p), (2, 3 * p), (3, 2 * p), (4, p)]:
            verify(build_schedule("interleaved", p, m, v), p, m, v)


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("fn", [gpipe, one_f_one_b])
@pytest.mark.parametrize("b", [1, 2])
def test_gpipe_1f1b_bubble(fn, b, lazy):
    for p in PS:
        for m in ms(p):
            t = simulate(fn(p, m), unit(b=b), lazy_sends=lazy)
            assert t.bubble_fraction == Fr(p - 1, m + p - 1), (p, m)
            assert t.makespan == (m + p - 1) * (1 + b)


@pytest.mark.parametrize("lazy", [False, True])
@pytest.mark.parametrize("b", [1, 2])
def test_interleaved_divides_bubble_by_v(b, lazy):
    # time unit = 1/v of a full stage: a chunk costs F=1, B=b; a full 1F1B stage F=v, B=b*v
    for p in PS:
        for v, m in [(2, p), (2, 2 * p), (3, p), (3, 3 * p), (4, 2 * p)]:
            t = simulate(interleaved_1f1b(p, m, v), unit(1, b), lazy_sends=lazy)
            assert t.bubble_fraction == Fr(p - 1, v * m + p - 1), (p, v, m)
            base = simulate(one_f_one_b(p, m), unit(v, b * v))
            idle, base_idle = t.makespan - t.busy(0), base.makespan - base.busy(0)
            assert idle * v == base_idle


@pytest.mark.parametrize("lazy", [False, True])
def test_zb_h1_bubble(lazy):
    for p in PS:
        for m in ms(p) + [3 * (p - 1), 4 * p]:
            if m < 1:
                continue
            zb = simulate(zb_h1(p, m), unit(), lazy_sends=lazy)
            base = simulate(one_f_one_b(p, m), unit(b=2))
            assert zb.bubble_fraction <= base.bubble_fraction
            if m >= p:
                assert zb.makespan == 3 * m + p - 1, (p, m)
                assert zb.bubble_fraction == Fr(p - 1, 3 * m + p - 1)
                assert 3 * (zb.makespan - zb.busy(0)) == base.makespan - base.busy(0)
            if m >= max(p, 3 * (p - 1)):
                assert zb.bubble_fraction <= Fr(2, 5) * base.bubble_fraction, (p, m)


def test_peak_in_flight():
    for p in PS:
        for m in ms(p):
            g, f, z = gpipe(p, m), one_f_one_b(p, m), zb_h1(p, m)
            assert peak_in_flight(g[0]) == m
            assert peak_in_flight(f[0]) == min(p, m)
            for r in range(p):
                assert peak_in_flight(f[r]) == min(p - r, m)
                assert peak_in_flight(z[r]) == peak_in_flight(f[r])
                assert peak_in_flight(z[r], until_weight=True) <= min(p, m)
    for p, m, v in [(2, 4, 2), (4, 8, 2), (4, 4, 3)]:
        sched = interleaved_1f1b(p, m, v)
        for r in range(p):  # Megatron: warm-up forwards + 1 chunk-microbatches
            assert peak_in_flight(sched[r]) == min(2 * (p - r - 1) + (v - 1) * p + 1, m * v)


def test_argument_errors():
    for bad in [(0, 4), (2, 0), (-1, 1)]:
        with pytest.raises(ValueError):
            one_f_one_b(*bad)
    with pytest.raises(ValueError, match="multiple of the pipeline size"):
        interleaved_1f1b(4, 6, 2)
    with pytest.raises(ValueError, match="v >= 2"):
        interleaved_1f1b(2, 4, 1)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("pipedream", 2, 4)
    with pytest.raises(ValueError, match="one model chunk per rank"):
        build_schedule("1f1b", 2, 4, v=2)
    with pytest.raises(ValueError, match="peer"):
        Action(K.SEND_ACT, 0)
    assert build_schedule("ZB_H1", 2, 4) == zb_h1(2, 4)


# ---- broken schedules are rejected with the rank and the action in the message ----

def _remove(sched, rank, action):
    out = [list(a) for a in sched]
    out[rank].remove(action)
    return out


def test_dropped_send():
    sched = _remove(one_f_one_b(3, 4), 1, Action(K.SEND_ACT, 0, 0, 2))
    with pytest.raises(ScheduleError) as e:
        verify(sched, 3, 4)
    msg = str(e.value)
    assert "rank 2: RECV_ACT(mb=0, chunk=0, peer=1)" in msg
    assert "no matching SEND_ACT(mb=0, chunk=0, peer=2) on rank 1" in msg


def test_dropped_receive():
    sched = _remove(gpipe(2, 2), 1, Action(K.RECV_ACT, 1, 0, 0))
    with pytest.raises(ScheduleError, match=r"rank 1: FORWARD\(mb=1, chunk=0\).*input arrived"):
        verify(sched, 2, 2)


def test_hoisted_receive_deadlocks():
    # rank 0 waits for microbatch 1's gradient before it has sent microbatch 1 forward
    sched = [list(a) for a in one_f_one_b(2, 2)]
    rg1 = Action(K.RECV_GRAD, 1, 0, 1)
    sched[0].remove(rg1)
    sched[0].insert(2, rg1)
    with pytest.raises(ScheduleError) as e:
        verify(sched, 2, 2)
    msg = str(e.value)
    assert "deadlock" in msg and "rank 0" in msg and "RECV_GRAD(mb=1, chunk=0, peer=1)" in msg


def test_swapped_receives_from_one_peer_break_fifo_order():
    sched = [list(a) for a in interleaved_1f1b(2, 4, 2)]
    row = sched[0]
    i = next(i for i in range(len(row) - 1) if row[i].kind.is_recv and row[i + 1].kind.is_recv
             and row[i].peer == row[i + 1].peer)
    row[i], row[i + 1] = row[i + 1], row[i]
    with pytest.raises(ScheduleError) as e:
        verify(sched, 2, 4, 2)
    msg = str(e.value)
    assert "rank 0:" in msg and "matched in order" in msg and str(row[i]) in msg


def test_swapped_receives_across_peers():
    sched = [list(a) for a in one_f_one_b(3, 3)]
    row = sched[1]
    ra, rg = Action(K.RECV_ACT, 1, 0, 0), Action(K.RECV_GRAD, 0, 0, 2)
    i, j = row.index(ra), row.index(rg)
    row[i], row[j] = rg, ra
    with pytest.raises(ScheduleError, match=r"rank 1: FORWARD\(mb=1, chunk=0\)"):
        verify(sched, 3, 3)


def test_duplicate_forward():
    sched = [list(a) for a in gpipe(2, 3)]
    sched[0].insert(1, Action(K.FORWARD, 0, 0))
    with pytest.raises(ScheduleError, match=r"rank 0: FORWARD\(mb=0, chunk=0\).*more than once"):
        verify(sched, 2, 3)


def test_backward_before_forward():
    sched = [list(a) for a in one_f_one_b(3, 2)]
    row = sched[2]
    i, j = row.index(Action(K.FORWARD, 0, 0)), row.index(Action(K.BACKWARD, 0, 0))
    row[i], row[j] = row[j], row[i]
    with pytest.raises(ScheduleError,
                       match=r"rank 2: BACKWARD\(mb=0, chunk=0\).*before its FORWARD"):
        verify(sched, 3, 2)


def test_other_malformations():
    with pytest.raises(ScheduleError, match=r"rank 0: BACKWARD_WEIGHT\(mb=3, chunk=0\) never"):
        verify(_remove(zb_h1(2, 4), 0, Action(K.BACKWARD_WEIGHT, 3, 0)), 2, 4)
    wrong_peer = [list(a) for a in gpipe(3, 1)]
    wrong_peer[0][1] = Action(K.SEND_ACT, 0, 0, 2)
    with pytest.raises(ScheduleError, match=r"rank 0: SEND_ACT.*peer 2.*on rank 1"):
        verify(wrong_peer, 3, 1)
    with pytest.raises(ScheduleError, match="one action list per rank"):
        verify(gpipe(2, 2), 3, 2)
    with pytest.raises(ScheduleError, match="out of range"):
        verify(gpipe(2, 3), 2, 2)


# ---- printing, timelines, plots ----

def test_format_schedule():
    text = format_schedule(one_f_one_b(2, 2))
    assert text.splitlines() == [
        "rank 0: F0 [sa0>1] F1 [sa1>1 rg0<1] B0 [rg1<1] B1",
        "rank 1: [ra0<0] F0 B0 [sg0>0 ra1<0] F1 B1 [sg1>0]",
    ]
    assert "F0c1" in format_schedule(interleaved_1f1b(2, 2, 2))
    assert format_schedule(zb_h1(1, 2)) == "rank 0: F0 I0 W0 F1 I1 W1"


def test_timeline_from_measured_events():
    sim = simulate(zb_h1(3, 6), unit())
    shifted = [(r, a, s + 1000.5, e + 1000.5) for r, a, s, e in sim.records()]
    measured = Timeline.from_events(shifted)
    assert measured.num_ranks == 3 and measured.makespan == sim.makespan
    assert measured.bubble_fraction == pytest.approx(float(sim.bubble_fraction))
    assert format_timeline(measured) == format_timeline(sim)
    assert format_timeline(sim).splitlines()[2].startswith("rank 2: .  .  F0 I0 F1 I1")
    slow_last = simulate(one_f_one_b(3, 4), lambda rank, a: 2 if rank == 2 else 1)
    assert slow_last.makespan > simulate(one_f_one_b(3, 4), {K.BACKWARD: 1}).makespan


def test_plots(tmp_path):
    sim = simulate(interleaved_1f1b(2, 4, 2))
    png = plot_timeline(sim, tmp_path / "t.png", title="interleaved")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    svg = plot_side_by_side(sim, simulate(one_f_one_b(2, 4)), tmp_path / "s.svg")
    assert b"<svg" in svg.read_bytes()[:2000]
