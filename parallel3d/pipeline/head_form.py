"""Which form of the fused LM-head loss a schedule wants (``model.fused_head_form=auto``): a pure
function of the schedule's actions.

The fused head (``kernels/fused_linear_cross_entropy.py``) has two forms with the same loss and gradients.
``summed`` forms the gradients in the forward (a (V/tp, h) fp32 d weight accumulator and d hidden (n, h),
about 2 GiB at Llama-3 8B's vocabulary) and holds them until the head's backward: three matmuls per chunk.
``per_token`` keeps only the per-row lse and recomputes each chunk's logits in the backward: four matmuls
per chunk, next to nothing held between forward and backward. The summed form's set is held once per
microbatch whose head forward has run and whose head backward has not, so the rule is:

    head_in_flight(schedule) > 1  ->  per_token      else  summed     (summed where the head's backward is split)

A split backward (``BACKWARD_INPUT`` then ``BACKWARD_WEIGHT``, the zero-bubble schedules) keeps the head's
saved tensors until the weight pass (``backward.py`` retains the graph for it), so a microbatch leaves
at ``BACKWARD`` or ``BACKWARD_WEIGHT``. With one stage (pp=1) the schedule's list is what runs: 1F1B's is
forward, backward per microbatch (summed); GPipe's runs every forward first (per_token).
"""
from __future__ import annotations

from typing import Sequence

from .actions import Action, ActionKind
from .placement import locate, placement_for

K = ActionKind
_LEAVES = frozenset({K.BACKWARD, K.BACKWARD_WEIGHT})  # the head's saved tensors are freed here


def head_holder(schedule: Sequence[Sequence[Action]]) -> tuple[int, int]:
    """(pipeline rank, local chunk) holding the last global stage (the LM head) of ``schedule``."""
    p = len(schedule)
    v = 1 + max((a.chunk for acts in schedule for a in acts), default=0)
    return locate(p * v - 1, p, placement_for(schedule))


def head_in_flight(schedule: Sequence[Sequence[Action]]) -> int:
    """The largest number of microbatches whose head forward has run and whose head backward has not, on
    the rank and chunk that hold the head (the rank's list in order)."""
    rank, chunk = head_holder(schedule)
    live: set[int] = set()
    peak = 0
    for a in schedule[rank]:
        if a.chunk != chunk:
            continue
        if a.kind is K.FORWARD:
            live.add(a.microbatch)
            peak = max(peak, len(live))
        elif a.kind in _LEAVES:
            live.discard(a.microbatch)
    return peak


def head_backward_split(schedule: Sequence[Sequence[Action]]) -> bool:
    """Whether the head's backward runs as an input pass and a weight pass (``BACKWARD_WEIGHT`` on its chunk)."""
    rank, chunk = head_holder(schedule)
    return any(a.kind is K.BACKWARD_WEIGHT and a.chunk == chunk for a in schedule[rank])


def fused_head_form(schedule: Sequence[Sequence[Action]]) -> str:
    """The concrete ``model.fused_head_form`` for ``auto``: ``per_token`` when the head holds more than one
    microbatch in flight under ``schedule``, else ``summed``; ``summed`` also where the head's backward is
    split: the fused head is one autograd node, whose backward runs in the input pass and again in the
    weight pass, and per_token would recompute its logits in each (8 matmuls a chunk against summed's 3,
    whose second run only scales what it holds)."""
    if head_backward_split(schedule):
        return "summed"
    return "per_token" if head_in_flight(schedule) > 1 else "summed"
