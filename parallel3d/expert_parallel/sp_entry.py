"""The MoE router under sequence parallelism: it reads the (b, s/tp, h) shard, never the gathered tokens.

The router runs on this rank's tokens (its GEMM saves only the shard, the fp32 copy of which is tp times
smaller than one of the gathered tokens). Capacity, the auxiliary losses and the load telemetry need the
routing of the whole (TP-local) sequence, so its logits and scores (one all-gather) and chosen experts (a
second) are gathered along the sequence: per token the same computation as on the gathered tokens. This
rank's own routing (its chosen experts and combine weights) drives its dispatch (sp_dispatch.py).

Gradients: the combine weights' gradient reaches the router directly, on this rank's tokens only, and is
whole (sp_dispatch.py sums the expert outputs over TP before the combine). The gathered logits and scores
carry the auxiliary losses' gradient, which every TP rank computes alike with weight 1/tp
(MoELayer._aux): their backward reduce-scatters it, so each rank gets its tokens' whole share. The router
weight's gradient dW = d_logits_shard^T x_shard is then this rank's tokens' part, summed over TP
(meta.grad_reduce) to the world-size-1 total.
"""
from __future__ import annotations

import torch

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.expert_parallel.router import Router, Routing
from parallel3d.tensor_parallel import gather_from_sp
from parallel3d.tensor_parallel.mappings import SEQ_DIM


def route_on_shard(router: Router, x: torch.Tensor, group: Group) -> tuple[Routing, Routing]:
    """x (b, s/tp, h) -> (the Routing of the gathered b * s tokens, without combine weights; this rank's
    Routing of its b * s/tp tokens)."""
    b, s_local, h = x.shape
    local = router(x.reshape(b * s_local, h))  # (b * s/tp, .) per field
    e, k = local.logits.shape[-1], local.indices.shape[-1]
    dense = torch.cat([local.logits, local.scores], -1).view(b, s_local, 2 * e)  # fp32
    dense = gather_from_sp(dense, group).reshape(-1, 2 * e)  # (T, 2E)
    indices = comm.all_gather(local.indices.view(b, s_local, k), group, SEQ_DIM).reshape(-1, k)  # (T, k)
    logits, scores = dense.split([e, e], -1)
    return Routing(logits, scores, indices, None), local
