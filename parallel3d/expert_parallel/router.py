"""Top-k router, load-balancing statistics, capacity (token dropping) and auxiliary-loss-free bias.

Shapes: T tokens (b*s flattened), E experts, k experts per token, h hidden.

Scores are softmax (Mixtral) or sigmoid (DeepSeek-V3) of the fp32 router logits. Selection is the top-k
of `scores + expert_bias`; the combine weights are the chosen *scores* (optionally normalised over the k),
so the balancing bias steers which experts are used without scaling any expert's output
(DeepSeek-V3, "auxiliary-loss-free load balancing").

Capacity rule (capacity_factor > 0): capacity groups are *sequences*. Each expert accepts at most
    C = ceil(capacity_factor * seq_len * top_k / num_experts)
slots per sequence, where seq_len is the full (un-sharded) sequence length, and keeps the slots of the
earliest positions; later slots are dropped: they are never sent and contribute nothing (the residual
carries the token), and the token's other combine weights are not renormalised (Switch/GShard).
Because the rule only looks at one sequence in position order, the same slots are dropped under any data,
expert, tensor or pipeline layout and any micro-batching (context parallelism gathers the routing
decisions of the whole sequence first).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.params import ParamMeta, full_slices, new_param

SCORES = ("softmax", "sigmoid")


@dataclass
class Routing:
    """One router decision for T tokens."""
    logits: torch.Tensor    # (T, E) fp32
    scores: torch.Tensor    # (T, E) fp32 softmax probabilities or sigmoid scores
    indices: torch.Tensor   # (T, k) int64 chosen experts (by scores + bias), best first
    weights: torch.Tensor   # (T, k) fp32 combine weights (from scores only)


class Router(nn.Module):
    """Linear gate (E, h) replicated over TP, plus the per-expert balancing bias (a buffer).

    Under TP every rank routes the same tokens identically but sees only its partial expert outputs, so
    its router-weight gradient is partial: it is summed over TP (meta.grad_reduce).
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, tp: Group, score: str = "softmax",
                 norm_topk: bool = True, std: Optional[float] = None) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"model.num_experts must be positive for an MoE layer, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"model.moe_top_k={top_k} must be in [1, num_experts={num_experts}]")
        if score not in SCORES:
            raise ValueError(f"model.router_score must be one of {SCORES}, got {score!r}")
        self.num_experts, self.top_k, self.score, self.norm_topk = num_experts, top_k, score, norm_topk
        shape = (num_experts, hidden)
        tp_groups = ("tp",) if tp.size > 1 else ()
        self.weight = new_param(shape, ParamMeta(shape, full_slices(shape), std=std, grad_reduce=tp_groups,
                                                 replicated=tp_groups))
        # Persistent buffer (checkpoint state, identical on every rank); `meta` lets checkpoint code treat it
        # like a replicated parameter.
        self.register_buffer("expert_bias", torch.zeros(num_experts))
        self.expert_bias.meta = ParamMeta((num_experts,), full_slices((num_experts,)), init="zeros")

    def _apply(self, fn, recurse: bool = True):
        """`.to(device / dtype)` replaces buffers: keep the bias fp32 (its steps are tiny) and its `meta`."""
        meta = self.expert_bias.meta
        out = super()._apply(fn, recurse)
        self._buffers["expert_bias"] = self._buffers["expert_bias"].float()
        self.expert_bias.meta = meta
        return out

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.weight.float())  # (T, E)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()  # (T, E)
        with torch.no_grad():
            _, indices = torch.topk(scores + self.expert_bias, self.top_k, dim=-1)  # (T, k)
        weights = scores.gather(1, indices)  # (T, k)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return Routing(logits, scores, indices, weights)


# ---- balancing statistics -----------------------------------------------------------------------------
def expert_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(T, k) chosen experts -> (E,) int64 number of slots per expert.

    A scatter-add rather than bincount: its output size is fixed by num_experts, so it also runs on
    shape-only tensors (the dry run), and integer adds are exact in any order."""
    flat = indices.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def balance_probs(scores: torch.Tensor, score: str) -> torch.Tensor:
    """(T, E) per-token distribution over experts used by the Switch loss: the softmax probabilities, or
    the sigmoid scores normalised to sum to 1 (DeepSeek-V3's form)."""
    return scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)


def switch_aux_loss(prob_sum: torch.Tensor, counts: torch.Tensor, tokens: torch.Tensor | float, top_k: int
                    ) -> torch.Tensor:
    """Switch/GShard load-balancing loss E * sum_e f_e * P_e from (global) sums.

    f_e = counts_e / (k T): fraction of routed slots that went to e (sums to 1; not differentiable);
    P_e = prob_sum_e / T: mean router probability of e (differentiable). Perfect balance gives 1.
    (Hugging Face's Mixtral loss for one layer equals k times this value: its f sums to k.)
    """
    num_experts = prob_sum.shape[0]
    f = counts.float() / (top_k * tokens)  # (E,)
    p = prob_sum / tokens  # (E,)
    return num_experts * (f * p).sum()


def z_loss_sum(logits: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of logsumexp(logits)^2 (ST-MoE router z-loss before the mean)."""
    return torch.logsumexp(logits, dim=-1).square().sum()


@torch.no_grad()
def update_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> None:
    """DeepSeek-V3: bias_e += rate * sign(mean_load - load_e); overloaded experts become less attractive."""
    load = load.to(bias.dtype)
    bias.add_(rate * torch.sign(load.mean() - load))


# ---- capacity --------------------------------------------------------------------------------------------
def expert_capacity(capacity_factor: float, seq_len: int, top_k: int, num_experts: int) -> int:
    """Slots per expert per sequence (see the module docstring); 0 factor means drop-less (returns -1)."""
    if capacity_factor <= 0:
        return -1
    return max(1, math.ceil(capacity_factor * seq_len * top_k / num_experts))


def capacity_keep_mask(indices: torch.Tensor, capacity: int, num_experts: int) -> torch.Tensor:
    """indices (b, s, k) in position order -> keep (b, s, k) bool: a slot is kept when fewer than
    `capacity` earlier positions of its sequence chose the same expert."""
    onehot = F.one_hot(indices, num_experts).sum(2)  # (b, s, E) 0/1: a token picks an expert at most once
    before = onehot.cumsum(1) - onehot  # (b, s, E) exclusive count of earlier positions
    return before.gather(2, indices) < capacity  # (b, s, k)


def sharded_capacity_keep_mask(indices: torch.Tensor, capacity: int, num_experts: int, cp: Group,
                               positions: Optional[torch.Tensor]) -> torch.Tensor:
    """capacity_keep_mask when the sequence is split over the CP group: every rank gathers the (int)
    routing decisions and positions of the whole sequence, ranks all slots in position order, and keeps
    the answer for its own tokens. indices (b, s/cp, k), positions (s/cp,) -> keep (b, s/cp, k)."""
    if cp.size == 1:
        return capacity_keep_mask(indices, capacity, num_experts)
    if positions is None:
        raise ValueError("capacity-based token dropping under context parallelism needs the token positions")
    s_local = indices.shape[1]
    all_idx = comm.all_gather(indices.contiguous(), cp, dim=1)  # (b, s, k) in rank order
    all_pos = comm.all_gather(positions.to(indices.device).long().contiguous(), cp, dim=0)  # (s,)
    order = torch.argsort(all_pos)  # rank order -> position order
    keep_sorted = capacity_keep_mask(all_idx[:, order], capacity, num_experts)  # (b, s, k)
    keep = torch.empty_like(keep_sorted)
    keep[:, order] = keep_sorted  # back to rank order
    return keep[:, cp.rank * s_local:(cp.rank + 1) * s_local]
