"""Replay a schedule in virtual time: timelines, bubble fraction and activation memory.

The simulator follows the runtime's rules exactly (see ``schedules.py``): a rank runs its list in
order; a run of consecutive communication actions is one group that is posted at once and
completes when every message in it has been matched. A message is *rendezvous*: it is delivered at
``max(send posted, receive posted) + comm cost``, so a send never completes before its receive is
posted. That is the pessimistic model (NCCL behaves like this for large tensors); a schedule that
finishes here cannot deadlock on a real transport that buffers more. ``lazy_sends=True`` models a
runtime that waits only for a group's receives (sends complete in the background); with free
communication every built-in schedule has the same makespan under both models.

:class:`Timeline` is deliberately plain data - per-rank ``(start, end, action)`` events - so a
runtime can build one from measured ``(rank, action, start, end)`` records and the same plots and
bubble arithmetic apply to both. Times may be ints, floats or ``fractions.Fraction`` (exact tests).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterable, Mapping, NamedTuple, Sequence, Union

from .placement import locate, placement_for, stage_of
from .posting import READS, receives_early, sends_early, split_steps  # noqa: F401  (split_steps re-exported)
from .schedules import Action, ActionKind, ScheduleError

K = ActionKind
DEFAULT_COSTS: Mapping[ActionKind, float] = {
    K.FORWARD: 1, K.BACKWARD: 2, K.BACKWARD_INPUT: 1, K.BACKWARD_WEIGHT: 1,
    K.SEND_ACT: 0, K.RECV_ACT: 0, K.SEND_GRAD: 0, K.RECV_GRAD: 0,
}
Costs = Union[Mapping[ActionKind, float], Callable[[int, Action], float], None]


class Event(NamedTuple):
    """One action on one rank from ``start`` to ``end`` (simulated units or seconds)."""

    start: float
    end: float
    action: Action


@dataclass
class Timeline:
    """Per-rank event lists (``events[rank]``, sorted by start), simulated or measured."""

    events: list[list[Event]] = field(default_factory=list)

    @classmethod
    def from_events(cls, records: Iterable[tuple[int, Action, float, float]],
                    num_ranks: int | None = None, normalize: bool = True) -> "Timeline":
        """Build from ``(rank, action, start, end)`` records, e.g. measured by the runtime.

        ``normalize`` shifts all times so the earliest start is 0 (wall clocks are absolute).
        """
        records = list(records)
        n = num_ranks if num_ranks is not None else 1 + max((r for r, *_ in records), default=-1)
        t0 = min((s for _, _, s, _ in records), default=0) if normalize else 0
        events: list[list[Event]] = [[] for _ in range(n)]
        for rank, action, start, end in records:
            if end < start:
                raise ValueError(f"rank {rank}: {action} ends ({end}) before it starts ({start})")
            events[rank].append(Event(start - t0, end - t0, action) if t0 else
                                Event(start, end, action))
        for evs in events:
            evs.sort(key=lambda e: (e.start, e.end))
        return cls(events)

    @property
    def num_ranks(self) -> int:
        return len(self.events)

    @property
    def makespan(self) -> float:
        """Time from the first start to the last end on any rank."""
        all_events = [e for evs in self.events for e in evs]
        if not all_events:
            return 0
        return max(e.end for e in all_events) - min(e.start for e in all_events)

    def busy(self, rank: int) -> float:
        """Compute time of ``rank`` (communication and waiting are not work)."""
        return sum((e.end - e.start for e in self.events[rank] if e.action.kind.is_compute), 0)

    @property
    def bubble_fraction(self) -> float:
        """Idle compute time / (p * makespan): 0 means every rank computed all the time.

        Exact (a ``Fraction``) when all times are integers or fractions, a float otherwise.
        """
        span = self.makespan
        if span == 0:
            return 0
        total = self.num_ranks * span
        idle = total - sum(self.busy(r) for r in range(self.num_ranks))
        if isinstance(total, (int, Fraction)) and isinstance(idle, (int, Fraction)):
            return Fraction(idle, total)  # exact for integer / rational times
        return idle / total

    def records(self) -> list[tuple[int, Action, float, float]]:
        """The inverse of :meth:`from_events`."""
        return [(r, e.action, e.start, e.end) for r, evs in enumerate(self.events) for e in evs]


def _cost_fn(costs: Costs) -> Callable[[int, Action], float]:
    if callable(costs):
        return costs
    table = dict(DEFAULT_COSTS)
    table.update(costs or {})
    return lambda rank, action: table[action.kind]


def message_key(rank: int, action: Action, p: int, placement: str = "loop") -> tuple:
    """Identity of the tensor a comm action moves: ``(src, dst, channel, mb, producer stage)``.

    A send and the receive it pairs with have equal keys; activations flow from stage ``s`` to
    ``s + 1`` and gradients from ``s + 1`` back to ``s``.
    """
    s = stage_of(rank, action.chunk, p, placement)
    kind, peer = action.kind, action.peer
    if kind is K.SEND_ACT:
        return (rank, peer, "act", action.microbatch, s)
    if kind is K.RECV_ACT:
        return (peer, rank, "act", action.microbatch, s - 1)
    if kind is K.SEND_GRAD:
        return (rank, peer, "grad", action.microbatch, s)
    if kind is K.RECV_GRAD:
        return (peer, rank, "grad", action.microbatch, s + 1)
    raise ValueError(f"{action} is not a communication action")


def simulate(schedules: Sequence[Sequence[Action]], costs: Costs = None, lazy_sends: bool = False,
             placement: str | None = None, early_receives: bool = False, early_sends: bool = False) -> Timeline:
    """Simulated timeline of ``schedules``; raises :class:`ScheduleError` on deadlock.

    ``costs`` maps :class:`ActionKind` to a duration (missing kinds take the defaults F=1, B=2,
    I=W=1, communication 0) or is a callable ``(rank, action) -> duration`` for uneven stages.
    A message costs the larger of its send's and its receive's cost. With ``lazy_sends`` a group
    waits only for its receives (a runtime that finishes sends in the background).

    Messages are paired by identity (:func:`message_key` plus occurrence count), like tagged
    point-to-point; ``verify`` separately checks that FIFO (untagged) pairing gives the same pairs.
    Communication actions get events from the moment their group is posted until it completes.
    ``placement`` (``placement.py``) defaults to the one a ``Schedule`` carries, else ``loop``.
    The gloo runtime's plan (``runtime_schedules.rank_plan``), with ``lazy_sends``: ``early_receives``
    posts each receive one group early and the compute that reads it waits for it (not its group);
    ``early_sends`` posts each send right after the compute that produced it (DualPipe-V): a pair's
    messages then travel while its other half computes.
    """
    placement = placement_for(schedules, placement)
    if (early_sends or early_receives) and not lazy_sends:
        raise ValueError("early receives / sends need lazy_sends: a blocking group would wait for its peer")
    if early_sends:
        schedules = [sends_early(acts) for acts in schedules]
    if early_receives:
        schedules = [receives_early(acts) for acts in schedules]
    p = len(schedules)
    cost = _cost_fn(costs)
    steps = [split_steps(acts) for acts in schedules]
    idx, clock = [0] * p, [0] * p
    posted: dict[tuple, tuple[float, int, Action]] = {}  # (is_send, key, n) -> (time, rank, act)
    group_ids: list[list[tuple]] = [[] for _ in range(p)]  # ids of the group a rank has posted
    inbox: list[dict[tuple, tuple]] = [{} for _ in range(p)]  # early receives: (kind, mb, chunk) -> id
    seen: Counter = Counter()
    records: list[tuple[int, Action, float, float]] = []
    progress = True
    while progress:
        progress = False
        for r in range(p):
            while idx[r] < len(steps[r]):
                step = steps[r][idx[r]]
                if isinstance(step, Action):
                    start = clock[r]
                    want = (READS.get(step.kind), step.microbatch, step.chunk)
                    if want in inbox[r]:  # an early receive: this compute waits for it
                        arrived = _group_done([inbox[r][want]], posted, cost, False)
                        if arrived is None:
                            break
                        got = inbox[r].pop(want)
                        records.append((r, posted[got][2], posted[got][0], max(arrived, posted[got][0])))
                        start = max(start, arrived)
                    end = start + cost(r, step)
                    records.append((r, step, start, end))
                    clock[r], idx[r], progress = end, idx[r] + 1, True
                    continue
                if not group_ids[r]:  # post the whole group at once
                    for a in step:
                        key = (a.kind.is_send, message_key(r, a, p, placement))
                        seen[key] += 1
                        posted[key + (seen[key],)] = (clock[r], r, a)
                        if early_receives and a.kind.is_recv:
                            inbox[r][(a.kind, a.microbatch, a.chunk)] = key + (seen[key],)
                        else:
                            group_ids[r].append(key + (seen[key],))
                    progress = True
                done = _group_done(group_ids[r], posted, cost, lazy_sends)
                if done is None:
                    break
                done = max(done, clock[r])
                records += [(r, a, clock[r], done) for a in step if not (early_receives and a.kind.is_recv)]
                clock[r], idx[r], group_ids[r], progress = done, idx[r] + 1, [], True
    blocked = [r for r in range(p) if idx[r] < len(steps[r])]
    if blocked:
        lines = ["deadlock: no rank can make progress"]
        for r in blocked:
            step = steps[r][idx[r]]
            if isinstance(step, Action):  # a compute waiting for an early receive
                _, _, a = posted[inbox[r][(READS.get(step.kind), step.microbatch, step.chunk)]]
                lines.append(f"  rank {r}'s {step} waits for {a}: rank {a.peer} never sends it")
                continue
            group = " ".join(a.short() for a in step)
            waiting = [i for i in group_ids[r] if (not i[0], *i[1:]) not in posted]
            _, _, a = posted[waiting[0]]
            lines.append(f"  rank {r} is blocked in group [{group}] on {a}: rank {a.peer} has "
                         f"not posted the matching {partner(r, a, p, placement)}")
        raise ScheduleError("\n".join(lines))
    for (is_send, *rest), (_, r, a) in posted.items():
        if (not is_send, *rest) not in posted:
            raise ScheduleError(f"rank {r}: {a} is never matched by {partner(r, a, p, placement)} on "
                                f"rank {a.peer}")
    return Timeline.from_events(records, num_ranks=p, normalize=False)


def _group_done(ids: list[tuple], posted: dict, cost: Callable[[int, Action], float],
                lazy_sends: bool) -> float | None:
    """When a posted group completes, or None while a partner has not posted its side yet."""
    done = 0
    for is_send, key, n in ids:
        if lazy_sends and is_send:
            continue
        other = posted.get((not is_send, key, n))
        if other is None:
            return None
        (t_self, r_self, a_self), (t_other, r_other, a_other) = posted[(is_send, key, n)], other
        done = max(done, max(t_self, t_other) + max(cost(r_self, a_self), cost(r_other, a_other)))
    return done


def partner(rank: int, action: Action, p: int, placement: str = "loop") -> Action:
    """The action the peer must list to complete communication ``action`` of ``rank``."""
    s = stage_of(rank, action.chunk, p, placement)
    other_stage = s + 1 if action.kind in (K.SEND_ACT, K.RECV_GRAD) else s - 1
    mirror = {K.SEND_ACT: K.RECV_ACT, K.RECV_ACT: K.SEND_ACT,
              K.SEND_GRAD: K.RECV_GRAD, K.RECV_GRAD: K.SEND_GRAD}[action.kind]
    return Action(mirror, action.microbatch, locate(other_stage, p, placement)[1], rank)


def peak_in_flight(schedule_rank: Iterable[Action], until_weight: bool = False) -> int:
    """Max number of (microbatch, chunk) whose forward ran and whose backward has not yet.

    By default a microbatch leaves when its input gradient is done (BACKWARD or BACKWARD_INPUT),
    the usual 1F1B memory count. ``until_weight=True`` keeps it until its weight gradient is done
    (BACKWARD or BACKWARD_WEIGHT), which also counts what zero-bubble schedules keep for W.
    """
    leave = {K.BACKWARD, K.BACKWARD_WEIGHT} if until_weight else {K.BACKWARD, K.BACKWARD_INPUT}
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in schedule_rank:
        if a.kind is K.FORWARD:
            live.add((a.microbatch, a.chunk))
            peak = max(peak, len(live))
        elif a.kind in leave:
            live.discard((a.microbatch, a.chunk))
    return peak
