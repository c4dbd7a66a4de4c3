"""The MoE layer's entry into the TP region under sequence parallelism, keeping only the (b, s/tp, h) shard.

The routed experts read the all-gathered tokens through an index (which saves only the indices), but the
router's GEMM and the shared experts' GEMMs would save the gathered (T, h) input (the router even an fp32
copy of it). Under sp they read the shard instead:
  - the router runs on this rank's tokens, and its decision (logits, scores, combine weights: one
    all-gather; chosen experts: a second) is gathered along the sequence. Per token the routing is the same
    computation as on the gathered tokens. Backward reduce-scatters the routing gradients (each TP rank
    holds a partial one, its expert outputs being partial), so the router's gradient on the shard is
    whole: dx_shard = d_logits_shard @ W, dW = d_logits_shard^T x_shard, summed over TP like before
    (meta.grad_reduce) to the same total;
  - the shared experts' GEMMs go through tensor_parallel.column_entry: they read the layer's gathered
    tokens in forward, keep the shard, and gather it again in backward (their partial dX joins the routed
    tokens' gradient, reduce-scattered once by the layer's entry).
"""
from __future__ import annotations

import torch

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.expert_parallel.router import Router, Routing
from parallel3d.tensor_parallel import gather_from_sp
from parallel3d.tensor_parallel.mappings import SEQ_DIM


def route_on_shard(router: Router, x: torch.Tensor, group: Group) -> Routing:
    """x (b, s/tp, h) -> the Routing of the gathered (b * s) tokens, computed on this rank's tokens."""
    b, s_local, h = x.shape
    r = router(x.reshape(b * s_local, h))  # (b * s/tp, .) per field
    e, k = r.logits.shape[-1], r.indices.shape[-1]
    dense = torch.cat([r.logits, r.scores, r.weights], -1).view(b, s_local, 2 * e + k)  # fp32
    dense = gather_from_sp(dense, group).reshape(-1, 2 * e + k)  # (T, 2E + k)
    indices = comm.all_gather(r.indices.view(b, s_local, k), group, SEQ_DIM).reshape(-1, k)  # (T, k)
    logits, scores, weights = dense.split([e, e, k], -1)
    return Routing(logits, scores, indices, weights)
