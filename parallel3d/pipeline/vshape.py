"""V-shaped schedules: ZB-V (Qi et al. 2023/24) and DualPipe-V (DeepSeek-V3's DualPipe folded in a V).

Both run two model chunks per rank on the ``v`` placement (``placement.py``): rank ``r`` holds stage
``r`` (chunk 0) and stage ``2p - 1 - r`` (chunk 1), so a microbatch goes down the ranks and comes back
up, and rank 0 holds both the embedding and the head. Both split backward into an input-gradient pass
``I`` and a weight-gradient pass ``W`` (``backward.py``) where that fills a bubble.

Each schedule is written as a compute order per rank; ``_timed`` replays it with unit costs
(F = I = W = 1, B = 2: a chunk holds half a stage, so these are half a stage's costs) and
``_lower_timed`` adds the communication. Every message gets one time ``T`` between its production and
its consumption at which *both* ranks sit between two computes (the latest such time, so the receiver
waits as little as possible), and goes into the group of that gap on both ranks, ordered by
``(T, message)``. Groups on all ranks are then posted in time order, each completing as soon as its
time comes, so blocking groups cannot deadlock and both ends list each pair's messages in the same
order (the verifier checks both anyway).
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Sequence

from .placement import Schedule, locate, stage_of
from .actions import Action, ActionKind, ScheduleError

K = ActionKind
_Op = tuple[ActionKind, int, int]              # (kind, global stage, microbatch)
_UNIT = {K.FORWARD: 1, K.BACKWARD: 2, K.BACKWARD_INPUT: 1, K.BACKWARD_WEIGHT: 1}


def _check_pm_v(name: str, p: int, m: int) -> None:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"pipeline size p must be an integer >= 1, got {p!r}")
    if not isinstance(m, int) or m < 2 * p:
        raise ValueError(f"{name} needs at least 2 * pp microbatches (m >= {2 * p} for pp={p}), "
                         f"got m={m!r}: each rank warms up on both of its chunks")


def _timed(p: int, orders: Sequence[Sequence[_Op]]) -> list[list[tuple[int, int]]]:
    """(start, end) of every op when each rank runs its order as soon as the inputs are ready."""
    last = 2 * p - 1
    end: dict[tuple[str, int, int], int] = {}   # ("F" | "I" | "W", stage, mb) -> end time
    out: list[list[tuple[int, int]]] = [[] for _ in orders]
    idx, clock = [0] * p, [0] * p
    progress = True
    while progress:
        progress = False
        for r, order in enumerate(orders):
            while idx[r] < len(order):
                kind, s, mb = order[idx[r]]
                if kind is K.FORWARD:
                    deps = [("F", s - 1, mb)] if s > 0 else []
                elif kind is K.BACKWARD_WEIGHT:
                    deps = [("I", s, mb)]
                else:
                    deps = [("F", s, mb)] + ([("I", s + 1, mb)] if s < last else [])
                if any(d not in end for d in deps):
                    break
                start = max([clock[r]] + [end[d] for d in deps])
                clock[r] = start + _UNIT[kind]
                out[r].append((start, clock[r]))
                tag = {K.FORWARD: "F", K.BACKWARD_WEIGHT: "W"}.get(kind, "I")
                end[(tag, s, mb)] = clock[r]
                if kind is K.BACKWARD:
                    end[("W", s, mb)] = clock[r]
                idx[r], progress = idx[r] + 1, True
    stuck = [r for r in range(p) if idx[r] < len(orders[r])]
    if stuck:
        r = stuck[0]
        raise ScheduleError(f"rank {r}: compute order waits forever at {orders[r][idx[r]]}")
    return out


class _Gaps:
    """The idle gaps of one rank's timeline: gap ``i`` lies before compute ``i`` (``len``: after the last)."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        self.starts = [a for a, _ in spans]
        self.ends = [b for _, b in spans]
        self.points = sorted(set(self.starts) | set(self.ends))

    def at(self, t: float) -> int | None:
        """The gap containing time ``t``, or None while a compute runs across ``t``."""
        i = bisect.bisect_left(self.starts, t)    # the first compute starting at or after t
        return i if i == 0 or self.ends[i - 1] <= t else None

    def points_in(self, lo: float, hi: float) -> list[float]:
        return self.points[bisect.bisect_left(self.points, lo):bisect.bisect_right(self.points, hi)]


def _lower_timed(p: int, orders: Sequence[Sequence[_Op]]) -> Schedule:
    """Compute orders -> action lists with time-aligned communication groups (module docstring)."""
    spans = _timed(p, orders)
    gaps = [_Gaps(sp) for sp in spans]
    last = 2 * p - 1
    made: dict[tuple[str, int, int], float] = {}       # (channel, producer stage, mb) -> ready time
    for r, order in enumerate(orders):
        for (kind, s, mb), (_, end) in zip(order, spans[r]):
            if kind is K.FORWARD and s < last:
                made[("act", s, mb)] = end
            if kind in (K.BACKWARD, K.BACKWARD_INPUT) and s > 0:
                made[("grad", s, mb)] = end
    groups: list[dict[int, list[tuple]]] = [dict() for _ in range(p)]
    for r, order in enumerate(orders):
        for (kind, s, mb), (start, _) in zip(order, spans[r]):
            if kind is K.FORWARD and s > 0:
                channel, src_stage = "act", s - 1
            elif kind in (K.BACKWARD, K.BACKWARD_INPUT) and s < last:
                channel, src_stage = "grad", s + 1
            else:
                continue
            src = locate(src_stage, p, "v")[0]
            if src == r:
                continue  # the turn of the V: same rank, no message
            ready = made[(channel, src_stage, mb)]
            candidates = sorted({start, ready, *gaps[src].points_in(ready, start),
                                 *gaps[r].points_in(ready, start)}, reverse=True)
            when = next((t for t in candidates if gaps[src].at(t) is not None
                         and gaps[r].at(t) is not None), None)
            if when is not None:
                send_at = recv_at = when
            else:  # a full backward (2 units) spans every common point: send at the sender's
                send_at = next(t for t in candidates if gaps[src].at(t) is not None)  # last gap
                recv_at = start
            key = (send_at, src, r, channel, src_stage, mb)
            sender = (K.SEND_ACT if channel == "act" else K.SEND_GRAD,
                      locate(src_stage, p, "v")[1], r)
            receiver = (K.RECV_ACT if channel == "act" else K.RECV_GRAD, locate(s, p, "v")[1], src)
            groups[src].setdefault(gaps[src].at(send_at), []).append((key, sender, mb))
            groups[r].setdefault(gaps[r].at(recv_at), []).append((key, receiver, mb))
    out = Schedule(placement="v")
    for r, order in enumerate(orders):
        acts: list[Action] = []
        for i in range(len(order) + 1):
            for _, (kind, chunk, peer), mb in sorted(groups[r].get(i, []), key=lambda x: x[0]):
                acts.append(Action(kind, mb, chunk, peer))
            if i < len(order):
                kind, s, mb = order[i]
                acts.append(Action(kind, mb, locate(s, p, "v")[1]))
        out.append(acts)
    return out


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V: zero-bubble on the V placement, at 1F1B's activation memory (needs m >= 2p).

    Rank ``r``'s first chunk-1 input arrives after the first microbatch went down and came back up
    to it, ``2(p - r) - 1`` forward slots after its first chunk-0 input: it fills them with chunk-0
    forwards, then alternates chunk-1 / chunk-0 forwards for ``r`` pairs (while the first input
    gradients travel from rank 0 down to it), then runs ``F I W`` on chunk 1 ``p - r`` times. The
    steady phase repeats ``F0 I0 W0 F1 I1 W1``; the cool-down runs the remaining input passes first
    (what the other ranks wait for) and fills the end with the postponed weight passes. Every rank
    holds at most ``2p`` chunk activations (``p`` stages' worth: 1F1B's peak on rank 0). p=2, m=4,
    compute order (``c1`` = chunk 1; ``format_schedule(zb_v(2, 4), comm=False)``)::

        rank 0: F0c0 F1c0 F2c0 F0c1 I0c1 W0c1 F1c1 I1c1 W1c1 F3c0 I0c0 W0c0 F2c1 I2c1 W2c1 I1c0 ...
        rank 1: F0c0 F0c1 F1c0 F1c1 I0c1 W0c1 F2c0 I0c0 W0c0 F2c1 I1c1 W1c1 F3c0 I1c0 W1c0 F3c1 ...
    """
    _check_pm_v("zb-v", p, m)
    f, i, w = K.FORWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT
    orders: list[list[_Op]] = []
    for r in range(p):
        s0, s1 = stage_of(r, 0, p, "v"), stage_of(r, 1, p, "v")
        nf, ni = [0, 0], [0, 0]          # forwards and input passes issued per chunk
        pending: list[deque] = [deque(), deque()]   # input passes whose weight pass is postponed
        order: list[_Op] = []
        stage = (s0, s1)

        def run(kind: ActionKind, c: int, keep_weight: bool = False) -> None:
            if kind is f:
                order.append((f, stage[c], nf[c]))
                nf[c] += 1
            elif kind is i:
                order.append((i, stage[c], ni[c]))
                pending[c].append(ni[c])
                ni[c] += 1
                if not keep_weight:
                    order.append((w, stage[c], pending[c].popleft()))

        for _ in range(2 * (p - r) - 1):
            run(f, 0)
        for _ in range(r):
            run(f, 1)
            run(f, 0)
        for _ in range(p - r):
            run(f, 1)
            run(i, 1)
        while nf[0] < m or nf[1] < nf[0]:
            if nf[0] < m:
                run(f, 0)
            run(i, 0)
            run(f, 1)
            run(i, 1)
        for _ in range(r):               # input passes first: ranks above wait for them
            run(i, 0, keep_weight=True)
            run(i, 1, keep_weight=True)
        while ni[0] < m:
            run(i, 0, keep_weight=True)
            order.append((w, s0, pending[0].popleft()))
        for c in (1, 0):
            order += [(w, stage[c], mb) for mb in pending[c]]
        orders.append(order)
    return _lower_timed(p, orders)


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipe-V (DeepSeek-V3's DualPipe on ``p`` ranks folded into a V; needs m >= 2p).

    DualPipe pairs one microbatch's forward on one chunk with another microbatch's full backward on
    the other chunk, so that the communication of each hides behind the computation of the other.
    What overlaps here: the pair's *pipeline* messages, where each point-to-point op completes on its
    own (gloo): the runtime's plan (``runtime_schedules.rank_plan``, ``PAIRED``) posts the F's output
    right after the F, so it travels during the B, and the B's output gradient before the F, waited
    inside the B. The computes themselves run one after the other. Not overlapped: the pair's
    messages on NCCL (each group runs as listed and is waited whole before the next compute), and the
    expert-parallel all-to-all, which runs inside each F and B (DeepSeek-V3 also splits those into
    chunks interleaved with the partner's compute). Rank ``r``: ``2(p - r - 1)`` chunk-0 forwards; ``r + 1`` pairs of forwards (chunk 0,
    chunk 1); ``p - r - 1`` times ``I W F`` on chunk 1 (zero-bubble: the weight pass right away);
    the main phase of ``m - 2p + r + 1`` rounds ``(F0, B1) (F1, B0)``; ``p - r - 1`` rounds
    ``B1 (F1, B0)``; ``r + 1`` rounds ``B1 B0`` whose second half only runs input passes and
    postpones the weight passes; ``p - r - 1`` rounds ``W I0`` (chunk 0 input passes, a postponed
    weight pass in front of each); the remaining weight passes. The full backward ``B`` is used
    where no bubble is left to fill with a weight pass.
    """
    _check_pm_v("dualpipe-v", p, m)
    f, b, i, w = K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT
    orders: list[list[_Op]] = []
    for r in range(p):
        stage = (stage_of(r, 0, p, "v"), stage_of(r, 1, p, "v"))
        nf, nb = [0, 0], [0, 0]
        postponed: deque = deque()       # (stage, mb) whose weight pass waits
        order: list[_Op] = []

        def fwd(c: int) -> None:
            order.append((f, stage[c], nf[c]))
            nf[c] += 1

        def bwd(c: int, split: bool = False) -> None:
            order.append((i if split else b, stage[c], nb[c]))
            if split:
                postponed.append((stage[c], nb[c]))
            nb[c] += 1

        def weight() -> None:
            s, mb = postponed.popleft()
            order.append((w, s, mb))

        for _ in range(2 * (p - r - 1)):
            fwd(0)
        for _ in range(r + 1):
            fwd(0)
            fwd(1)
        for _ in range(p - r - 1):
            bwd(1, split=True)
            weight()
            fwd(1)
        for _ in range(m - 2 * p + r + 1):
            fwd(0)
            bwd(1)
            fwd(1)
            bwd(0)
        for _ in range(p - r - 1):
            bwd(1)
            fwd(1)
            bwd(0)
        split = False
        for k in range(r + 1):
            if k == (r + 1) // 2 and r % 2 == 1:
                split = True
            bwd(1, split)
            if k == (r + 1) // 2 and r % 2 == 0:
                split = True
            bwd(0, split)
        for _ in range(p - r - 1):
            weight()
            bwd(0, split=True)
        while postponed:
            weight()
        orders.append(order)
    return _lower_timed(p, orders)
