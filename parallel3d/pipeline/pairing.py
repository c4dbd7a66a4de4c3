"""Pairs of computes that run interleaved, so one microbatch's expert all-to-all hides behind another's
compute (``parallel.ep_overlap``; Megatron-Core's 1F1B all-to-all overlap, DeepSeek-V3's DualPipe pairs).

A pure list transform of one rank's actions. Where a forward and a backward (B or I) of *different*
microbatches follow each other with at most one communication group between them, the group's receives
move before the first compute and its sends after the second, so the two become adjacent and both have
their inputs before either starts::

    F(k) [sa k, rg j] B(j)       ->      [rg j] (F(k) B(j)) [sa k]

    1F1B steady state on rank r:   ... F(k) | B(j) F(k+1) | B(j+1) ...  (pairs in parentheses)
    p = 1:                         F0 (B0 F1) (B1 F2) ... B(m-1)

Different microbatches share no dependency inside a rank, so the pair may run in any interleaving
(``interleave.py`` runs it in turns at the all-to-alls). Moving a receive earlier and a send later can
change who waits for whom across ranks: the transformed schedule is verified whole (``verify.py``) before it
runs, by the schedule cache. A pair holds one more microbatch's activations than the F or B alone would at
the moment they meet (the forward's, while the backward frees its own): at most one more per rank.
"""
from __future__ import annotations

from typing import Sequence

from .actions import Action, ActionKind
from .posting import split_steps

K = ActionKind
BACKWARDS = (K.BACKWARD, K.BACKWARD_INPUT)
# schedules whose steady state alternates forwards and backwards (the ones a pair is made from)
PAIRABLE = ("1f1b", "interleaved", "dualpipe-v")

Pair = tuple[Action, Action]


def check_ep_overlap(schedule: str, ep: int, zero: int, offload_params: str = "none") -> None:
    """parallel.ep_overlap's requirements (ValueError naming the keys): a schedule with backward/forward
    pairs, expert all-to-alls to hide, and parameters that stay put between the two (ZeRO-3 gathers and frees
    each unit around its use, and the pair's forward and backward would free each other's units)."""
    if schedule not in PAIRABLE:
        raise ValueError(f"parallel.ep_overlap=true needs parallel.schedule in {', '.join(PAIRABLE)} (the "
                         f"schedules whose backwards and forwards alternate), got {schedule!r}")
    if ep < 2:
        raise ValueError(f"parallel.ep_overlap=true hides the expert all-to-alls: it needs parallel.ep > 1, "
                         f"got ep={ep}")
    if zero == 3 or offload_params != "none":
        raise ValueError("parallel.ep_overlap=true with parallel.zero=3 (or offload_params) is not supported: "
                         "ZeRO-3 gathers and frees each unit's parameters around its use, and a pair's forward "
                         "and backward use the same units in turns")


def _pairable(x: Action, y: Action, adjacent: bool) -> bool:
    """A backward then a forward of another microbatch; back to back in the schedule, either order. (A
    forward first with messages moved would hold its output back until the backward ran: on the rank after
    it, that backward's gradient then waits for this forward, and 1F1B deadlocks; the verifier shows it.)"""
    if x.microbatch == y.microbatch:
        return False
    if x.kind in BACKWARDS and y.kind is K.FORWARD:
        return True
    return adjacent and x.kind is K.FORWARD and y.kind in BACKWARDS


def pair_computes(actions: Sequence[Action], move_messages: bool = True) -> tuple[list[Action], list[Pair]]:
    """One rank's list -> (the list with each pair adjacent, the pairs in order); see the module docstring.
    Greedy from the start: a compute joins at most one pair. `move_messages=False` pairs only computes the
    schedule already runs back to back (interleaved 1F1B's ``B F``)."""
    steps = split_steps(actions)
    out: list = []
    pairs: list[Pair] = []
    i = 0
    while i < len(steps):
        x = steps[i]
        if isinstance(x, list):
            out.append(list(x))
            i += 1
            continue
        between = steps[i + 1] if i + 1 < len(steps) and isinstance(steps[i + 1], list) else []
        j = i + 1 + (1 if between else 0)
        y = steps[j] if j < len(steps) else None
        if y is None or isinstance(y, list) or not _pairable(x, y, not between) or (between and not move_messages):
            out.append(x)
            i += 1
            continue
        receives = [a for a in between if a.kind.is_recv]
        sends = [a for a in between if not a.kind.is_recv]
        if receives:  # joins the group before the pair, after what it already holds
            if out and isinstance(out[-1], list):
                out[-1] += receives
            else:
                out.append(receives)
        out += [x, y]
        pairs.append((x, y))
        if sends:  # heads the group after the pair
            nxt = steps[j + 1] if j + 1 < len(steps) and isinstance(steps[j + 1], list) else None
            if nxt is not None:
                out.append(sends + nxt)
                j += 1
            else:
                out.append(sends)
        i = j + 1
    flat: list[Action] = []
    for s in out:
        flat += s if isinstance(s, list) else [s]
    return flat, pairs


def paired_schedule(lists: Sequence[Sequence[Action]], move_messages: bool = True
                    ) -> tuple[list[list[Action]], list[list[Pair]]]:
    """Every rank's list paired (pair_computes); the caller verifies the result (the placement of a
    `placement.Schedule` is kept by the caller, which rebuilds it with the new lists)."""
    done = [pair_computes(a, move_messages) for a in lists]
    return [d[0] for d in done], [d[1] for d in done]
