"""Plain synchronous gradient reduction: the reference the bucketed/overlapped paths must match.

Loss convention (docs/architecture.md section 2.2): every rank's loss is (sum of its token losses) / (target tokens in the
global batch), so gradients are SUMMED (not averaged) over the ranks that saw different tokens:
  dense weights over DP x CP, expert weights (meta.expert) over expert-DP,
  plus each group named in meta.grad_reduce (partial gradients of the same slice: "tp" for
  sequence-parallel norms and replicated kv heads, "embedding" for tied embeddings across stages).
"""
from __future__ import annotations

from typing import Iterable

import torch

from parallel3d import comm
from parallel3d.mesh import ParallelContext


def reduction_groups(p: torch.nn.Parameter, ctx: ParallelContext) -> list[comm.Group]:
    meta = p.meta
    groups = [ctx.edp if meta.expert else ctx.dp_cp]
    groups += [getattr(ctx, name) for name in meta.grad_reduce]
    return [g for g in groups if g is not None and g.size > 1]


@torch.no_grad()
def reduce_gradients(params: Iterable[torch.nn.Parameter], ctx: ParallelContext) -> None:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        for group in reduction_groups(p, ctx):
            comm.all_reduce(p.grad, group)
