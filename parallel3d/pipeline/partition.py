"""Split transformer layers over pipeline stages.

There are ``S = pp * v`` stages in global order (which rank holds stage ``s`` is the schedule's
placement, ``placement.py``: rank ``s % pp`` as chunk ``s // pp``, or a V for ZB-V / DualPipe-V).
Layers are contiguous: stage 0 gets the first ones. The embedding sits on stage 0 and the LM head with the loss on stage ``S - 1``; both cost time, so a
balanced split gives those stages fewer layers. Costs are in units of one transformer layer::

    num_layers=10, pp=4, embedding_cost=1, head_cost=1  ->  [0, 1] [2, 3, 4] [5, 6, 7] [8, 9]
    stage cost:                                              1+2    3         3         2+1

A stage may hold no layer only if it holds the embedding or the head (the first or last stage),
so ``S`` can be at most ``num_layers + 2``.
"""
from __future__ import annotations

import functools
from typing import Sequence


def _check_counts(counts: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    counts = list(counts)
    if len(counts) != num_stages:
        raise ValueError(f"layers_per_stage has {len(counts)} entries but there are "
                         f"{num_stages} pipeline stages (pp * v)")
    for s, n in enumerate(counts):
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"layers_per_stage[{s}] = {n!r}: must be an integer >= 0")
        if n == 0 and 0 < s < num_stages - 1:
            raise ValueError(f"layers_per_stage[{s}] = 0: only the first stage (embedding) or "
                             f"the last stage (LM head) may hold no transformer layer")
    if sum(counts) != num_layers:
        raise ValueError(f"layers_per_stage {counts} sums to {sum(counts)}, but the model has "
                         f"{num_layers} layers")
    return counts


def balanced_counts(num_layers: int, num_stages: int, embedding_cost: float = 1.0,
                    head_cost: float = 1.0) -> list[int]:
    """_balanced_counts' split, remembered: a layout search asks for the same few tens of thousands of times."""
    return list(_balanced_counts(num_layers, num_stages, embedding_cost, head_cost))


@functools.lru_cache(maxsize=1024)
def _balanced_counts(num_layers: int, num_stages: int, embedding_cost: float, head_cost: float) -> tuple[int, ...]:
    """Layers per stage minimising the most expensive stage (ties: fewer empty stages).

    Water-filling: every middle stage first gets the one layer it must hold, then each further
    layer goes to the currently cheapest stage. With unit-cost layers this greedy choice is optimal
    for the maximum stage cost; among equally cheap stages the one with fewer layers wins, so end
    stages are not left empty when there are layers to spare.
    """
    extra = [0.0] * num_stages
    extra[0] += embedding_cost
    extra[-1] += head_cost
    counts = [0 if s in (0, num_stages - 1) else 1 for s in range(num_stages)]
    for _ in range(num_layers - sum(counts)):
        s = min(range(num_stages), key=lambda i: (extra[i] + counts[i], counts[i], i))
        counts[s] += 1
    return tuple(counts)


def partition_layers(num_layers: int, pp: int, v: int = 1,
                     layers_per_stage: Sequence[int] | None = None,
                     embedding_cost: float = 1.0, head_cost: float = 1.0) -> list[list[int]]:
    """Layer indices of each of the ``pp * v`` stages, in global stage order.

    ``layers_per_stage`` overrides the balanced split (validated: one entry per stage, sums to
    ``num_layers``, zero only on the first or last stage). ``embedding_cost`` / ``head_cost`` are
    the extra work of stage 0 / the last stage in units of one layer (0 for a plain even split).
    """
    for name, value in (("num_layers", num_layers), ("pp", pp), ("v", v)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if embedding_cost < 0 or head_cost < 0:
        raise ValueError("embedding_cost and head_cost must be >= 0")
    num_stages = pp * v
    if num_stages > num_layers + 2:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} pipeline stages (pp={pp} x v={v}):"
            f" every stage but the first (embedding) and last (LM head) needs at least one layer,"
            f" so at most num_layers + 2 = {num_layers + 2} stages")
    if layers_per_stage is not None:
        counts = _check_counts(layers_per_stage, num_layers, num_stages)
    else:
        counts = balanced_counts(num_layers, num_stages, embedding_cost, head_cost)
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out
