"""The schedules a runtime runs: training schedules built and verified once (:class:`ScheduleCache`),
each rank's list turned once into the steps the runtime walks (:func:`rank_plan`), and the
forward-only order of evaluation (:func:`forward_only_schedule`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from .actions import Action, ActionKind
from .pairing import paired_schedule
from .placement import locate, stage_of
from .schedules import build_schedule
from .posting import receives_early, sends_early, split_steps
from .verify import verify

K = ActionKind


@dataclass(frozen=True)
class Post:
    """Communication posted together: ``ops`` in posting order (sends of the computes before, and the
    receives of the group as scheduled, or with early receives those of the next group)."""
    ops: tuple[Action, ...]


@dataclass(frozen=True)
class Pair:
    """Two computes of different microbatches run in turns, a backward and a forward (``pairing.py``;
    ``interleave.py`` hands the turn over at each expert all-to-all), ``first`` first. ``posts``: the group
    that early posting (gloo) placed between the two (``first``'s outputs, and receives of later computes),
    posted as soon as ``first`` is done, so it travels while the partner finishes (DualPipe's pairs)."""
    first: Action
    second: Action
    posts: tuple[Action, ...] = ()


Step = Union[Action, Post, Pair]


# Schedules whose plan also posts each send right after the compute that made it (``rank_plan``'s
# ``early_sends``): DualPipe-V, whose point is that a pair's F and B hide each other's communication.
PAIRED = frozenset({"dualpipe-v"})


def rank_plan(actions: Sequence[Action], early: bool, early_sends: bool = False,
              pairs: Sequence[tuple[Action, Action]] = ()) -> tuple[Step, ...]:
    """One rank's list as the runtime walks it: compute actions and :class:`Post` groups.

    ``early``: every group's receives move to the group before it (the first group's to a new one
    at the start of the list), so a receive is posted before the compute that precedes its own
    group and travels while that compute runs; it is waited by the compute that reads it. Sends
    stay where they are (after the compute that produced them) and receives keep their order.
    ``early_sends`` (with ``early`` only): each send is posted right after the compute that produced
    it instead, as long as no earlier-listed send to the same peer is passed (FIFO pairing); it
    travels during the next compute and is waited at the end of the step (lazy sends).
    ``pairs`` (``pairing.pair_computes``, back to back in ``actions``): each becomes one :class:`Pair`
    step; a group that early posting put between its two computes goes with it (``Pair.posts``)."""
    if early:
        actions = receives_early(sends_early(actions) if early_sends else actions)
    steps: list[Step] = []
    paired = {first: second for first, second in pairs}
    for s in split_steps(actions):
        if isinstance(s, list):
            steps.append(Post(tuple(s)))
        elif steps and isinstance(steps[-1], Action) and paired.get(steps[-1]) == s:
            steps[-1] = Pair(steps[-1], s)
        elif (early and len(steps) > 1 and type(steps[-1]) is Post and isinstance(steps[-2], Action)
              and paired.get(steps[-2]) == s):
            posts = steps.pop().ops
            steps[-1] = Pair(steps[-1], s, posts)
        else:
            steps.append(s)
    return tuple(steps)


class ScheduleCache:
    """Built and verified schedules by (name, p, m, v), and each rank's plan: verification replays
    the whole schedule, so a trainer that keeps one of these pays for it once instead of every step."""

    def __init__(self) -> None:
        self._lists: dict[tuple, list[list[Action]]] = {}
        self._pairs: dict[tuple, list[list[tuple[Action, Action]]]] = {}
        self._plans: dict[tuple, tuple[Step, ...]] = {}

    def get(self, name: str, p: int, m: int, v: int) -> list[list[Action]]:
        key = (name, p, m, v)
        if key not in self._lists:
            lists = build_schedule(name, p, m, v)  # ValueError with the user's mistake, unchanged
            verify(lists, p, m, v)
            self._lists[key] = lists
        return self._lists[key]

    def pairs(self, name: str, p: int, m: int, v: int, rank: int) -> list[tuple[Action, Action]]:
        """This rank's forward/backward pairs (parallel.ep_overlap; pairing.py), in order."""
        key = (name, p, m, v)
        if key not in self._pairs:
            self._pairs[key] = paired_schedule(self.get(name, p, m, v))
        return self._pairs[key][rank]

    def plan(self, name: str, p: int, m: int, v: int, rank: int, early: bool, paired: bool = False
             ) -> tuple[Step, ...]:
        key = (name, p, m, v, rank, early, paired)
        if key not in self._plans:
            pairs = self.pairs(name, p, m, v, rank) if paired else ()
            self._plans[key] = rank_plan(self.get(name, p, m, v)[rank], early, early_sends=name in PAIRED,
                                         pairs=pairs)
        return self._plans[key]


def forward_only_schedule(p: int, m: int, v: int = 1, placement: str = "loop") -> list[list[Action]]:
    """Evaluation order: every rank walks its (microbatch, stage) in order with its receives and
    sends. Deadlock-free: each message goes from (mb, s) to (mb, s + 1), later in every list."""
    out: list[list[Action]] = []
    for r in range(p):
        acts: list[Action] = []
        for mb in range(m):
            for s in sorted(stage_of(r, c, p, placement) for c in range(v)):
                c = locate(s, p, placement)[1]
                prev = locate(s - 1, p, placement)[0] if s > 0 else r
                nxt = locate(s + 1, p, placement)[0] if s < p * v - 1 else r
                if prev != r:
                    acts.append(Action(K.RECV_ACT, mb, c, prev))
                acts.append(Action(K.FORWARD, mb, c))
                if nxt != r:
                    acts.append(Action(K.SEND_ACT, mb, c, nxt))
        out.append(acts)
    return out
