"""Multi-token prediction (DeepSeek-V3, `model.mtp_depth` D > 0, `model.mtp_loss_coef` lambda), training only.

Module k = 1..D on the last pipeline stage, chained from the main model's final hidden states h^0 (before
the final norm), for every position i:

    h'_i   = W_k [enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)]      (2h -> h; [embedding ; hidden], the order of
                                                              DeepSeek's released MTP weights)
    h^k    = Block_k(h')                                     (MLA + MoE, causal over the sequence)
    loss_k = sum_i CE(head(norm_k(h^k_i)), t_{i+k+1})        (shared LM head; targets past the window ignored)

and the stage adds lambda / D * sum_k loss_k to its summed token loss, so after the trainer divides by the
global target count N each depth weighs lambda / D (DeepSeek's L_MTP, normalised by N rather than by each
depth's slightly smaller target count). The embedding is the main one: itself on a single stage, the
tied LM head when embeddings are tied, else a copy tied to `embed.weight` whose gradient is summed with
the first stage's over the embedding group (as tied embeddings are). Context parallelism: the future tokens
t_{i+k} of a rank's positions live partly on other CP ranks, so the (integer) labels of the whole sequence
are all-gathered over CP first. Evaluation and inference (no grad, or no labels) skip MTP. With packed
documents the blocks are document-masked, but t_{i+k} near a document's end comes from the next document
(as the main loss's last target of a document does).
W_k is replicated over TP (its gradient rule is models/mla.py's LatentProjection rule).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parallel3d.models.mla import LatentProjection
from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.context_parallel import cp_chunk_indices
from parallel3d.mesh import ParallelContext
from parallel3d.tensor_parallel import RMSNorm
from parallel3d.tensor_parallel.cross_entropy import IGNORE_INDEX
from parallel3d.tensor_parallel.mappings import reduce_from_tp, reduce_scatter_to_sp


class MTPModule(nn.Module):
    """One prediction depth: norms, the 2h -> h projection and a transformer block (`block`)."""

    def __init__(self, cfg, ctx: ParallelContext, sp: bool, block: nn.Module) -> None:
        super().__init__()
        h, tp = cfg.hidden_size, ctx.tp
        self.enorm = RMSNorm(h, cfg.norm_eps, tp, sp, cfg.kernels)
        self.hnorm = RMSNorm(h, cfg.norm_eps, tp, sp, cfg.kernels)
        self.eh_proj = LatentProjection(2 * h, h, ctx, sp)
        self.block = block
        self.norm = RMSNorm(h, cfg.norm_eps, tp, sp, cfg.kernels)

    def forward(self, hidden: torch.Tensor, emb: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                position_ids: torch.Tensor, documents=None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (h^k for the next depth, norm_k(h^k) for the shared head). The norm runs here, inside this
        module's forward: ZeRO-3 gathers a module's parameters only around its own forward."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], -1))  # (b, s[/tp], h)
        x = self.block(x, cos, sin, position_ids, documents)
        return x, self.norm(x)


def vocab_embed(ids: torch.Tensor, weight: torch.Tensor, start: int, real: int, tp: Group, sp: bool) -> torch.Tensor:
    """VocabParallelEmbedding's lookup with a given (vocab-sharded) table, e.g. the tied LM head."""
    if tp.size == 1:
        return F.embedding(ids, weight)  # (b, s, h)
    local = ids - start
    outside = (local < 0) | (local >= real)
    out = F.embedding(local.masked_fill(outside, 0), weight).masked_fill(outside[..., None], 0.0)  # partial
    return reduce_scatter_to_sp(out, tp) if sp else reduce_from_tp(out, tp)


def future_labels(labels: torch.Tensor, shift: int, cp: Group) -> torch.Tensor:
    """labels (b, s/cp) = t_{p+1} at this rank's positions p -> t_{p+1+shift} (IGNORE_INDEX past the window).
    Under CP the whole sequence's labels are all-gathered (integers, no gradient) and re-indexed."""
    b, s_local = labels.shape
    if cp.size == 1:
        pad = labels.new_full((b, shift), IGNORE_INDEX)
        return torch.cat([labels[:, shift:], pad], 1)  # (b, s)
    seq = s_local * cp.size
    where = torch.cat([cp_chunk_indices(seq, cp.size, r) for r in range(cp.size)]).to(labels.device)  # rank order
    gathered = comm.all_gather(labels.contiguous(), cp, dim=1)  # (b, s) rank order
    full = torch.empty_like(gathered)
    full[:, where] = gathered  # (b, s) sequence order
    want = cp_chunk_indices(seq, cp.size, cp.rank).to(labels.device) + shift  # (s/cp,)
    out = full[:, want.clamp(max=seq - 1)]
    return out.masked_fill((want >= seq)[None, :], IGNORE_INDEX)  # (b, s/cp)
