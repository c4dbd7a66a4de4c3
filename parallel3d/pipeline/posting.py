"""When a rank posts its messages: a schedule's list regrouped for a runtime that waits less than the
schedule's strict model (``schedules.py``, rule 2). Pure list transforms, shared by the runtime's plan
(``runtime_schedules.rank_plan``) and the simulator that prices it (``simulate.simulate``).

- ``receives_early``: each receive one group early, waited by the compute that reads it (gloo).
- ``sends_early``: each send right after the compute that produced it (DualPipe-V's pairs on gloo: the
  F's output travels while its partner B computes). Sends are never waited where they are posted.
"""
from __future__ import annotations

from typing import Sequence

from .actions import Action, ActionKind

K = ActionKind
# the receive a compute reads: its input activation (F) or its output gradient (B, I)
READS = {K.FORWARD: K.RECV_ACT, K.BACKWARD: K.RECV_GRAD, K.BACKWARD_INPUT: K.RECV_GRAD}


def split_steps(actions: Sequence[Action]) -> list[Action | list[Action]]:
    """Group a rank's list into compute actions and communication groups (lists)."""
    steps: list[Action | list[Action]] = []
    for a in actions:
        if a.kind.is_comm:
            if steps and isinstance(steps[-1], list):
                steps[-1].append(a)
            else:
                steps.append([a])
        else:
            steps.append(a)
    return steps


def receives_early(actions: Sequence[Action]) -> list[Action]:
    """One rank's list with every group's receives moved to the group before it (the first group's to a
    new one at the start), order per kind kept: each receive is posted before the compute that precedes
    its own group and travels while that compute runs; the compute that reads it waits for it."""
    steps = split_steps(actions)
    if not steps or not isinstance(steps[0], list):
        steps = [[]] + steps
    groups = [i for i, s in enumerate(steps) if isinstance(s, list)]
    out: list[Action] = []
    for n, i in enumerate(groups):
        own = steps[i] if n == 0 else [a for a in steps[i] if not a.kind.is_recv]
        ahead = [a for a in steps[groups[n + 1]] if a.kind.is_recv] if n + 1 < len(groups) else []
        out += own + ahead
        out += steps[i + 1:groups[n + 1]] if n + 1 < len(groups) else steps[i + 1:]
    return out


def sends_early(actions: Sequence[Action]) -> list[Action]:
    """One rank's list with every send moved up to right after the compute that produced it, unless that
    would pass an earlier-listed send to the same peer (messages pair first-in first-out per peer).

    The send then travels while the next compute runs (DualPipe-V: the F's output behind its partner B).
    Valid only where a send is not waited at its group (lazy sends): a blocking group would wait there
    for the peer's receive, which the schedule posts at its own (later) time."""
    computes = [a for a in actions if a.kind.is_compute]
    made: dict[tuple, int] = {}          # (producer kinds, mb, chunk) -> its compute index
    for i, a in enumerate(computes):
        if a.kind is not K.BACKWARD_WEIGHT:  # W sends nothing
            made[(a.kind is K.FORWARD, a.microbatch, a.chunk)] = i
    gaps: list[list[Action]] = [[] for _ in range(len(computes) + 1)]   # gap k: before compute k
    last: dict[int, int] = {}            # peer -> gap of the last send to it
    k = 0
    for a in actions:
        if a.kind.is_compute:
            k += 1
        elif a.kind.is_send:             # F makes SEND_ACT, B / I make SEND_GRAD
            gap = max(made[(a.kind is K.SEND_ACT, a.microbatch, a.chunk)] + 1, last.get(a.peer, 0))
            last[a.peer] = gap
            gaps[gap].append(a)
        else:
            gaps[k].append(a)
    out: list[Action] = []
    for k, gap in enumerate(gaps):
        out += sorted(gap, key=lambda a: not a.kind.is_send)   # moved sends first; stable otherwise
        if k < len(computes):
            out.append(computes[k])
    return out


