"""Top-k router, load-balancing statistics, capacity (token dropping) and auxiliary-loss-free bias.

Shapes: T tokens (b*s flattened), E experts, k experts per token, h hidden.

Scores are softmax (Mixtral) or sigmoid (DeepSeek-V3) of the fp32 router logits. Selection is the top-k
of `scores + expert_bias`; the combine weights are the chosen *scores* (optionally normalised over the k),
so the balancing bias steers which experts are used without scaling any expert's output
(DeepSeek-V3, "auxiliary-loss-free load balancing").

DeepSeek-V3 additions (all off by default):
  group-limited routing   experts are cut into `num_groups` equal groups; a group's score is the sum of its two
                          best `scores + expert_bias`; a token keeps its `topk_groups` best groups and picks its
                          top-k experts only among them (node-limited routing when a group is a node's experts)
  routed_scaling_factor   the combine weights (after the optional normalisation) are multiplied by it
  sequence-wise aux loss  sequence_balance_loss below: per sequence E/(k T) * sum_e count_e * P_e, averaged
                          over sequences (P_e from the sigmoid scores normalised per token)

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


def check_group_limits(num_experts: int, top_k: int, num_groups: int, topk_groups: int) -> None:
    """Group-limited routing needs equal groups and enough experts inside the kept groups for top-k."""
    if num_groups < 1 or num_experts % num_groups:
        raise ValueError(f"model.router_num_groups={num_groups} must be >= 1 and divide model.num_experts="
                         f"{num_experts}")
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"model.router_topk_groups={topk_groups} must be in [1, router_num_groups={num_groups}]")
    if top_k > topk_groups * (num_experts // num_groups):
        raise ValueError(f"model.moe_top_k={top_k} exceeds the experts of the kept groups (router_topk_groups="
                         f"{topk_groups} x {num_experts // num_groups} experts per group)")


def group_limited_mask(choice: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """(T, E) selection scores -> (T, E) bool, True for the experts of each token's `topk_groups` best groups.
    A group's score is the sum of its two best selection scores (its best one when a group has one expert)."""
    t, e = choice.shape
    grouped = choice.view(t, num_groups, e // num_groups)  # (T, G, E/G)
    group_score = grouped.topk(min(2, e // num_groups), dim=-1).values.sum(-1)  # (T, G)
    best = group_score.topk(topk_groups, dim=-1).indices  # (T, topk_groups)
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)  # (T, G)
    return keep[:, :, None].expand(t, num_groups, e // num_groups).reshape(t, e)


@dataclass
class Routing:
    """One router decision for T tokens."""
    logits: torch.Tensor    # (T, E) fp32
    scores: torch.Tensor    # (T, E) fp32 softmax probabilities or sigmoid scores
    indices: torch.Tensor   # (T, k) int64 chosen experts (by scores + bias), best first
    weights: Optional[torch.Tensor]  # (T, k) fp32 combine weights (from scores only); None when gathered (SP)


class Router(nn.Module):
    """Linear gate (E, h) replicated over TP, plus the per-expert balancing bias (a buffer).

    Under TP its router-weight gradient is partial in every order of the MoE layer, so it is summed over TP
    (meta.grad_reduce): with etp == tp and no SP every rank routes the same tokens but sees only its partial
    expert outputs; under SP, or with experts folded across TP ranks (etp != tp), the combine weights'
    gradient reaches only the tokens this rank dispatched.
    """

    def __init__(self, hidden: int, num_experts: int, top_k: int, tp: Group, score: str = "softmax",
                 norm_topk: bool = True, std: Optional[float] = None, num_groups: int = 1, topk_groups: int = 1,
                 scaling_factor: float = 1.0) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"model.num_experts must be positive for an MoE layer, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"model.moe_top_k={top_k} must be in [1, num_experts={num_experts}]")
        if score not in SCORES:
            raise ValueError(f"model.router_score must be one of {SCORES}, got {score!r}")
        check_group_limits(num_experts, top_k, num_groups, topk_groups)
        self.num_experts, self.top_k, self.score, self.norm_topk = num_experts, top_k, score, norm_topk
        self.num_groups, self.topk_groups, self.scaling_factor = num_groups, topk_groups, scaling_factor
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
            choice = scores + self.expert_bias  # (T, E) selection scores
            if self.topk_groups < self.num_groups:
                choice = choice.masked_fill(~group_limited_mask(choice, self.num_groups, self.topk_groups),
                                            float("-inf"))
            _, indices = torch.topk(choice, self.top_k, dim=-1)  # (T, k)
        weights = scores.gather(1, indices)  # (T, k)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        if self.scaling_factor != 1.0:
            weights = weights * self.scaling_factor
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


def sequence_balance_stats(probs: torch.Tensor, indices: torch.Tensor, batch: int) -> torch.Tensor:
    """Per-sequence sums for the sequence-wise balance loss: probs (T, E) balance probabilities and indices
    (T, k) of T = batch * s tokens in sequence order -> (batch, 2E) [sum_t P_t,e | count_e] per sequence."""
    t, e = probs.shape
    counts = F.one_hot(indices, e).sum(1).to(probs.dtype)  # (T, E) 0/1
    return torch.cat([probs, counts], dim=-1).view(batch, t // batch, 2 * e).sum(1)  # (b, 2E)


def sequence_balance_loss(stats: torch.Tensor, seq_len: int, top_k: int) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss of each sequence from its (whole-sequence) sums:
    stats (b, 2E) -> (b,) L = sum_e f_e P_e with f_e = E / (k T) * count_e, P_e = prob_sum_e / T
    (T = seq_len tokens). Perfect balance inside the sequence gives 1; f is not differentiable."""
    e = stats.shape[-1] // 2
    f = stats[:, e:].detach() * (e / (top_k * seq_len))  # (b, E)
    p = stats[:, :e] / seq_len  # (b, E)
    return (f * p).sum(-1)


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
