"""All-gather context parallelism: gather the whole K/V sequence, attend locally with a global causal mask.

    rank r holds q chunks (r, 2cp-1-r); after the all-gather (rank order, reordered to global order)
    every rank holds K/V chunks c0 c1 ... c_{2cp-1}. Query chunk a sees keys [0, (a+1)c) with the
    diagonal block causal: a bottom-right aligned causal attention of q chunk a against k[:, :(a+1)c].

        cp = 2, rank 0:   q c0 -> k [c0]            (causal)
                          q c3 -> k [c0 c1 c2 c3]   (causal, bottom-right: c0..c2 full, c3 diagonal)

Communication: forward one all-gather of the packed (2, b, s, hk, d) K/V; backward one reduce-scatter of
dK/dV (each rank's partial gradients of every K/V position, summed on the owner). Simpler than the ring
and latency-friendly for GQA (small K/V), but every rank holds the whole K/V sequence.
"""
from __future__ import annotations

from typing import Optional

import torch

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.context_parallel.blocks import block_attention
from parallel3d.context_parallel.documents import Documents
from parallel3d.context_parallel.sharding import layout_permutation

SEQ = 2  # sequence dim of the packed (2, b, s, hk, d) K/V tensor


class GatherSequence(torch.autograd.Function):
    """Forward: all-gather along SEQ, then reorder rank order -> global order. Backward: the reverse
    reorder, then reduce-scatter (sum of every rank's gradient, each rank keeps its own shard)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        ctx.group = group
        full = comm.all_gather(x.contiguous(), group, SEQ)  # (2, b, s, hk, d) rank order
        order = layout_permutation(full.shape[SEQ], group.size).to(x.device)
        ctx.save_for_backward(order)
        return full.index_select(SEQ, order.argsort())  # global order

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (order,) = ctx.saved_tensors
        g_rank_order = g.index_select(SEQ, order)  # (2, b, s, hk, d)
        return comm.reduce_scatter(g_rank_order, ctx.group, SEQ), None  # (2, b, s/cp, hk, d)


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, causal: bool = True,
                        scale: Optional[float] = None, backend: str = "auto",
                        documents: Optional[Documents] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out (b, s/cp, hq, d), lse (b, hq, s/cp)); differentiable w.r.t. q, k, v.
    documents: the whole sequence's document ids (global order, as the gathered K/V)."""
    cp, r = group.size, group.rank
    c = q.shape[1] // 2
    kv = GatherSequence.apply(torch.stack([k, v]), group)  # (2, b, s, hk, d) global order
    q_doc = documents.local(cp, r) if documents is not None else None  # (b, s/cp)
    k_doc = documents.ids if documents is not None else None  # (b, s) global order
    if not causal:
        return block_attention(q, kv[0], kv[1], False, scale, backend, q_doc, k_doc)
    outs, lses = [], []
    for i, a in enumerate((r, 2 * cp - 1 - r)):  # local query chunk i has global chunk index a
        qs, ks = slice(i * c, (i + 1) * c), slice(0, (a + 1) * c)
        o, l = block_attention(q[:, qs], kv[0][:, ks], kv[1][:, ks], True, scale, backend,
                               None if q_doc is None else q_doc[:, qs],
                               None if k_doc is None else k_doc[:, ks])  # (b, c, hq, d), (b, hq, c)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs, 1), torch.cat(lses, 2)
