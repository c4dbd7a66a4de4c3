"""The schedules a runtime runs: training schedules built and verified once (:class:`ScheduleCache`),
and the forward-only order of evaluation (:func:`forward_only_schedule`)."""
from __future__ import annotations

from .actions import Action, ActionKind
from .placement import locate, stage_of
from .schedules import build_schedule
from .verify import verify

K = ActionKind


class ScheduleCache:
    """Built and verified schedules by (name, p, m, v): verification replays the whole schedule,
    so a trainer that keeps one of these pays for it once instead of every step."""

    def __init__(self) -> None:
        self._lists: dict[tuple[str, int, int, int], list[list[Action]]] = {}

    def get(self, name: str, p: int, m: int, v: int) -> list[list[Action]]:
        key = (name, p, m, v)
        if key not in self._lists:
            lists = build_schedule(name, p, m, v)  # ValueError with the user's mistake, unchanged
            verify(lists, p, m, v)
            self._lists[key] = lists
        return self._lists[key]


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
