"""Pairs of computes that run interleaved, so one microbatch's expert all-to-all hides behind another's
compute (``parallel.ep_overlap``; Megatron-Core's 1F1B all-to-all overlap, DeepSeek-V3's DualPipe pairs).

A pair is a forward and a backward (B or I) of *different* microbatches that the schedule already runs
back to back, with no communication between them. Different microbatches share no dependency inside a
rank, so the two may run in any interleaving (``interleave.py`` runs them in turns at the all-to-alls), and
the schedule's messages stay where they are::

    1F1B, p = 1:           F0 (B0 F1) (B1 F2) ... (B6 F7) B7
    interleaved 1F1B:      ... [sa rg] (F2c0 B0c1) [sa sg rg] (F3c0 B1c1) ...   (its steady state's "F B")
    DualPipe-V:            ... (F2c0 B0c1) ... (B1c1 F2c1) ...                   (DualPipe's F/B pairs)

Why not pair across a message group (moving its receives before the pair and its sends after it, which
1F1B at p > 1 would need): the verifier accepts that schedule for B-first pairs, but each pipeline hop then
waits for the partner too, and the simulated 1F1B step grows ~1.8x at p = 4 (interleaved and DualPipe-V
~1.3-1.7x). Megatron-Core's combined 1F1B likewise runs without pipelining or with virtual stages.
``check_ep_overlap`` refuses 1F1B at p > 1, where only the first stage (which receives no activation) has
pairs.
"""
from __future__ import annotations

from typing import Sequence

from .actions import Action, ActionKind

K = ActionKind
BACKWARDS = (K.BACKWARD, K.BACKWARD_INPUT)
# schedules whose computes include back-to-back forward/backward pairs (1f1b only at pp == 1)
PAIRABLE = ("1f1b", "interleaved", "dualpipe-v")

Pair = tuple[Action, Action]


def check_ep_overlap(schedule: str, ep: int, zero: int, offload_params: str = "none", pp: int = 1) -> None:
    """parallel.ep_overlap's requirements (ValueError naming the keys): a schedule with forward/backward
    pairs, expert all-to-alls to hide, and parameters that stay put between the two (ZeRO-3 gathers and frees
    each unit around its use, and the pair's forward and backward would free each other's units)."""
    if schedule not in PAIRABLE or (schedule == "1f1b" and pp > 1):
        raise ValueError(f"parallel.ep_overlap=true needs parallel.schedule in {', '.join(PAIRABLE)}, with 1f1b "
                         f"only at parallel.pp=1 (pipelined, it has a message between each forward and "
                         f"backward past the first stage: use interleaved or dualpipe-v), got schedule={schedule!r} "
                         f"pp={pp}")
    if ep < 2:
        raise ValueError(f"parallel.ep_overlap=true hides the expert all-to-alls: it needs parallel.ep > 1, "
                         f"got ep={ep}")
    if zero == 3 or offload_params != "none":
        raise ValueError("parallel.ep_overlap=true with parallel.zero=3 (or offload_params) is not supported: "
                         "ZeRO-3 gathers and frees each unit's parameters around its use, and a pair's forward "
                         "and backward use the same units in turns")


def _pairable(x: Action, y: Action) -> bool:
    return x.microbatch != y.microbatch and (
        (x.kind is K.FORWARD and y.kind in BACKWARDS) or (x.kind in BACKWARDS and y.kind is K.FORWARD))


def pair_computes(actions: Sequence[Action]) -> list[Pair]:
    """One rank's list -> its pairs in order (module docstring). Greedy from the start: a compute joins at
    most one pair."""
    pairs: list[Pair] = []
    i = 0
    while i + 1 < len(actions):
        x, y = actions[i], actions[i + 1]
        if x.kind.is_compute and y.kind.is_compute and _pairable(x, y):
            pairs.append((x, y))
            i += 2
        else:
            i += 1
    return pairs


def paired_schedule(lists: Sequence[Sequence[Action]]) -> list[list[Pair]]:
    """Every rank's pairs (pair_computes)."""
    return [pair_computes(a) for a in lists]
