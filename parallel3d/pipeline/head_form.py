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

from functools import lru_cache
from typing import Sequence

from .actions import Action, ActionKind
from .placement import check_schedule_config, locate, placement_for
from .schedules import build_schedule

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
    weight pass; per_token recomputes its logits in each, forming d hidden in the first and d weight in the
    second (5 matmuls a chunk against summed's 3, whose second run only scales what it holds), on the stage
    that carries the head, in schedules chosen for speed. per_token stays the explicit choice there."""
    if head_backward_split(schedule):
        return "summed"
    return "per_token" if head_in_flight(schedule) > 1 else "summed"


@lru_cache(maxsize=512)
def head_form_of(schedule: str, pp: int, microbatches: int, virtual_stages: int) -> str:
    """fused_head_form of the named schedule (what resolve_and_validate asks), built with at most about
    2 * pp * v microbatches: the most microbatches the head holds is reached within the warm-up and first
    steady round, so a longer list gives the same form (tests/test_fused_head_form.py checks it against the
    whole list), and a plan search that validates thousands of layouts builds no schedule of thousands of
    microbatches. The prefix is the smallest count from min(microbatches, 2 pp v) up that the schedule takes."""
    chunks = check_schedule_config(schedule, pp, virtual_stages, microbatches)
    probe = microbatches
    for m in range(min(microbatches, 2 * pp * chunks), microbatches):
        try:
            check_schedule_config(schedule, pp, virtual_stages, m)
        except ValueError:
            continue
        probe = m
        break
    return fused_head_form(build_schedule(schedule, pp, probe, chunks))
