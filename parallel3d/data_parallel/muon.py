"""Muon's arithmetic: the Newton-Schulz iteration, the learning-rate adjustment, which parameters are hidden
matrices (and their logical matrices), and the assignment of whole matrices to ranks. Pure functions;
the distributed step that uses them is muon_step.py.

Muon (Keller Jordan 2024; torch.optim.Muon; Moonlight's "Muon is Scalable for LLM Training"), per matrix
W with gradient G, momentum mu and buffer B:

    B <- lerp(B, G, 1 - mu)                       (B = mu B + (1 - mu) G)
    U <- lerp(G, B, mu) if nesterov else B
    O <- NS_k(U)                                  k quintic Newton-Schulz steps, ~ the orthogonal factor of U
    W <- W (1 - lr wd) - adjust(lr, shape) O

with torch.optim.Muon's coefficients, eps and adjustments ("original": sqrt(max(1, rows/cols)),
"match_rms_adamw": 0.2 sqrt(max(rows, cols)), which gives the update AdamW's RMS so one lr serves both).
The iteration runs in bf16 as torch's does (train.muon_ns_precision=bf16) or in fp32.

Which parameters: `ParamMeta.matrix` (set by the layers that build projections: column/row/KV-parallel
linears other than the vocabulary head, MLA's latent projections, stacked experts); everything else
(embedding, head, norms, biases, router) takes AdamW. `logical_matrices` is the one owner of how such a
parameter splits into the matrices Muon orthogonalises one by one:

    2-D (out, in)              one matrix, or meta.parts: rows [0, p0), [p0, p0 + p1), ... (fused q/k/v)
    3-D experts (E, out, in)   one matrix per expert
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from parallel3d.params import ParamMeta

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)   # torch.optim.Muon's (a, b, c), from Keller Jordan's post
NS_EPS = 1e-7
OPTIMIZERS = ("adamw", "muon")
ADJUST_LR = ("original", "match_rms_adamw")
NS_PRECISIONS = {"bf16": torch.bfloat16, "fp32": torch.float32}
TP_MODES = ("gather", "blockwise")


def check_muon(optimizer: str, momentum: float = 0.95, ns_steps: int = 5, adjust_lr_fn: str = "match_rms_adamw",
               ns_precision: str = "bf16", tp_mode: str = "gather", lr: float = 0.0,
               weight_decay: float = 0.0, offload_optimizer: str = "none") -> None:
    """train.optimizer and the train.muon_* keys; raises ValueError naming the key."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"train.optimizer={optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
    if optimizer != "muon":
        return
    if adjust_lr_fn not in ADJUST_LR:
        raise ValueError(f"train.muon_adjust_lr_fn={adjust_lr_fn!r} is not one of {', '.join(ADJUST_LR)}")
    if ns_precision not in NS_PRECISIONS:
        raise ValueError(f"train.muon_ns_precision={ns_precision!r} is not one of {', '.join(NS_PRECISIONS)}")
    if tp_mode not in TP_MODES:
        raise ValueError(f"train.muon_tp_mode={tp_mode!r} is not one of {', '.join(TP_MODES)}")
    if not 1 <= ns_steps < 100:
        raise ValueError(f"train.muon_ns_steps must be in [1, 100), got {ns_steps}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"train.muon_momentum must be in [0, 1), got {momentum}")
    if lr < 0 or weight_decay < 0:
        raise ValueError(f"train.muon_lr and train.muon_weight_decay must be >= 0, got {lr} and {weight_decay}")
    if offload_optimizer == "nvme":
        raise ValueError("train.optimizer=muon with parallel.offload_optimizer=nvme: the NVMe step streams AdamW's "
                         "state chunk by chunk, and Muon needs whole matrices; use offload_optimizer=cpu or none")


def check_muon_model(named: Sequence[tuple[str, torch.nn.Parameter]], tp_mode: str = "gather") -> None:
    """Muon needs at least one hidden matrix (ParamMeta.matrix), and each must split into logical
    matrices; blockwise orthogonalises TP shards, so no shard may be empty."""
    mats = [(n, p) for n, p in named if getattr(p, "meta", None) is not None and p.meta.matrix]
    if not mats:
        raise ValueError("train.optimizer=muon: the model has no hidden 2-D weights (no parameter is marked "
                         "ParamMeta.matrix), so Muon would optimise nothing; use train.optimizer=adamw")
    for n, p in mats:
        for m in logical_matrices(n, p.meta, tuple(p.shape)):
            if tp_mode == "blockwise" and min(m.rows, m.cols) < 1:
                raise ValueError(f"train.muon_tp_mode=blockwise: parameter {n}'s TP shard of a logical matrix is "
                                 f"{m.rows} x {m.cols}, not a 2-D matrix to orthogonalise")


@torch.no_grad()
def newton_schulz(u: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16, eps: float = NS_EPS,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS) -> torch.Tensor:
    """torch.optim.Muon's iteration on the 2-D u (rows, cols) in `dtype`, op for op (a tall matrix runs
    transposed); returns (rows, cols) in `dtype`. u is not modified."""
    a, b, c = coefficients
    x = u.to(dtype, copy=True)
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))     # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.T                  # (m, m), m = min(rows, cols)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)   # b A + c A^2
        x = torch.addmm(x, poly, x, beta=a)                     # a X + (b A + c A^2) X
    return x.T if tall else x


def adjust_lr(lr: float, fn: str, shape: Sequence[int]) -> float:
    """torch.optim.Muon's _adjust_lr for a (rows, cols) matrix."""
    rows, cols = shape[:2]
    if fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1, rows / cols))


def ns_flops(rows: int, cols: int, steps: int) -> int:
    """Matmul FLOPs of `steps` iterations on a (rows, cols) matrix (m = the shorter side): X X^T (2m^2 n),
    A A (2m^3), (..) X (2m^2 n) per step."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4 * m * m * n + 2 * m ** 3)


@dataclass(frozen=True)
class LogicalMatrix:
    """One matrix Muon orthogonalises, inside the TP-local parameter: flat elements [start, start + rows*cols)
    are its (rows, cols) C-contiguous block; `split` is the dimension TP splits (None: whole on this rank),
    `full` its shape with the TP shards joined."""
    start: int
    rows: int
    cols: int
    split: Optional[int]
    full: tuple[int, int]


def tp_split_dim(meta: ParamMeta, matrix_dims: int) -> Optional[int]:
    """Which of the last two dims (0 or 1 of the matrix) TP splits, from the slices; None when whole."""
    local, glob = meta.local_real_shape, meta.global_shape
    dims = [d for d in range(len(glob) - 2, len(glob)) if local[d] != glob[d]]
    if len(dims) > 1:
        raise ValueError(f"a matrix split along two dims ({local} of {glob}) cannot be joined for Muon")
    return dims[0] - (len(glob) - 2) if dims else None


def logical_matrices(name: str, meta: ParamMeta, shape: Sequence[int]) -> list[LogicalMatrix]:
    """The logical matrices of a `meta.matrix` parameter of TP-local `shape` (module docstring)."""
    if len(shape) not in (2, 3) or (len(shape) == 3 and not meta.expert):
        raise ValueError(f"parameter {name} of shape {tuple(shape)} is marked a matrix but is neither 2-D nor "
                         f"stacked experts (E, out, in): Muon orthogonalises 2-D matrices")
    rows, cols = shape[-2:]
    split = tp_split_dim(meta, 2)
    g_rows, g_cols = meta.global_shape[-2:]
    if len(shape) == 3:
        return [LogicalMatrix(e * rows * cols, rows, cols, split, (g_rows, g_cols)) for e in range(shape[0])]
    if not meta.parts:
        return [LogicalMatrix(0, rows, cols, split, (g_rows, g_cols))]
    factor = g_rows // rows if split == 0 else 1
    if sum(meta.parts) != g_rows or any(p % factor for p in meta.parts):
        raise ValueError(f"parameter {name}: parts {meta.parts} must sum to its {g_rows} rows and each split "
                         f"evenly over the {factor} TP ranks holding its rows")
    out, start = [], 0
    for part in meta.parts:
        local = part // factor
        out.append(LogicalMatrix(start, local, cols, split, (part, g_cols)))
        start += local * cols
    return out


def assign_owners(costs: Sequence[float], ranks: int) -> list[int]:
    """Each matrix's rank: longest processing time first (Megatron-Core's layer-wise assignment: the
    costliest matrix to the least-loaded rank, ties to the lower rank, equal costs in list order). A pure
    function of the costs, so every rank computes the same assignment."""
    loads, owner = [0.0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda k: (loads[k], k))
        owner[i] = r
        loads[r] += costs[i]
    return owner
