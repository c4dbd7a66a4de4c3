"""Cases of the option-combination sweep (tests/test_sweep.py), built from the options themselves.

Every case is a 4-rank layout (pipeline of 2 stages times one more dimension) trained for 3 steps through
the real Trainer and DistributedOptimizer, compared with the world-size-1 run of the same config.

CI runs a pairwise-covering subset: every pair of values of any two factors appears in at least one case
(greedy construction, deterministic). `make sweep` runs the full product.
"""
from __future__ import annotations

import itertools
from typing import Iterator

from parallel3d.data_parallel.precision import DTYPES
from parallel3d.pipeline.placement import V_SCHEDULES
from parallel3d.pipeline.schedules import SCHEDULE_NAMES

# the dimension beside pp=2 (4 ranks): each is an override list
SECOND_DIM = {
    "dp": ["parallel.dp=2"],
    "tp": ["parallel.tp=2"],
    "sp": ["parallel.tp=2", "parallel.sp=true"],
    "cp-ring": ["parallel.cp=2", "parallel.cp_mode=ring"],
    "cp-allgather": ["parallel.cp=2", "parallel.cp_mode=allgather"],
    "cp-ulysses": ["parallel.cp=2", "parallel.cp_mode=ulysses"],
    "ep": ["parallel.dp=2", "parallel.ep=2"],  # the Mixtral-style MoE model
}
FACTORS: dict[str, tuple] = {
    "schedule": SCHEDULE_NAMES,
    "zero": (0, 1, 2, 3),
    "precision": tuple(DTYPES),
    "dim": tuple(SECOND_DIM),
    "tied": (False, True),
    "recompute": ("none", "full", "selective"),
    "microbatches": (2, 4),   # per data-parallel rank: gradient accumulation (V schedules: at least 2*pp = 4)
    "clip": (1.0, 0.0),       # train.grad_clip; 0: no clipping (the weights then see more of a gradient's scale)
}
# No balancing losses: they are computed over each *global* micro-batch, which the rank-major sampler groups
# differently at dp=1 and dp=2 (their parity under DP is tested with one micro-batch in test_moe_parity).
MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "model.aux_loss_coef=0",
       "model.z_loss_coef=0"]


def overrides(case: dict) -> list[str]:
    """Config overrides of one case (without parallel.pp / world-size keys: see layout())."""
    dp = 2 if case["dim"] in ("dp", "ep") else 1
    microbatches = max(case["microbatches"], 4) if case["schedule"] in V_SCHEDULES else case["microbatches"]
    out = [f"parallel.schedule={case['schedule']}", f"parallel.zero={case['zero']}",
           f"train.precision={case['precision']}", f"model.tie_embeddings={str(case['tied']).lower()}",
           f"train.activation_checkpointing={case['recompute']}", "train.micro_batch_size=1",
           f"train.global_batch_size={microbatches * dp}", "model.num_layers=4", f"train.grad_clip={case['clip']}"]
    if case["schedule"] == "interleaved":
        out.append("parallel.virtual_stages=2")
    if case["dim"] == "ep":
        out += MOE
    return out


def reference(case: dict) -> list[str]:
    """Overrides of the world-size-1 run of the case (no pipeline: interleaving has nothing to interleave, the
    V-shaped schedules need pp >= 2)."""
    out = overrides(case)
    if case["schedule"] == "interleaved" or case["schedule"] in V_SCHEDULES:
        out = [o for o in out if not o.startswith(("parallel.schedule", "parallel.virtual_stages"))]
    return out


def layout(case: dict) -> list[str]:
    return ["parallel.pp=2", *SECOND_DIM[case["dim"]]]


def name(case: dict) -> str:
    words = {"tied": lambda v: "tied" if v else "untied", "clip": lambda v: f"clip{v:g}"}
    return "-".join(words.get(k, str)(v) for k, v in case.items())


def full_product() -> Iterator[dict]:
    """Every combination of the factors but clip, which alternates (by the parity of the other values'
    indices): each clip value still meets every value of every other factor, at the old case count."""
    keys = [k for k in FACTORS if k != "clip"]
    for picks in itertools.product(*(range(len(FACTORS[k])) for k in keys)):
        case = {k: FACTORS[k][i] for k, i in zip(keys, picks)}
        yield {**case, "clip": FACTORS["clip"][sum(picks) % len(FACTORS["clip"])]}


def _pairs(case: dict) -> set[tuple]:
    items = sorted(case.items())
    return {(a, b) for a, b in itertools.combinations(items, 2)}


def pairwise(factors: dict[str, tuple] = FACTORS, allowed=lambda case: True) -> list[dict]:
    """A small set of allowed cases covering every allowed pair of factor values (greedy; deterministic).

    Each round picks, from the full product, the allowed case covering most still-uncovered pairs (ties:
    first in product order). Pairs that no allowed case contains are not required. Each case's pairs are one
    integer with a bit per pair, so a round is an AND and a bit count per candidate (CI collects this in
    every worker: as sets of tuples it took 5 s)."""
    keys = list(factors)
    candidates = [dict(zip(keys, v)) for v in itertools.product(*(factors[k] for k in keys))]
    candidates = [c for c in candidates if allowed(c)]
    bit: dict[tuple, int] = {}
    masks = []
    for case in candidates:
        mask = 0
        for pair in _pairs(case):
            mask |= 1 << bit.setdefault(pair, len(bit))
        masks.append(mask)
    uncovered = (1 << len(bit)) - 1
    chosen = []
    while uncovered:
        best = max(range(len(candidates)), key=lambda i: (masks[i] & uncovered).bit_count())
        chosen.append(candidates[best])
        uncovered &= ~masks[best]
    return chosen
