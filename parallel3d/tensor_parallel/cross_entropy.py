"""Cross-entropy over vocabulary-parallel logits, never gathering the full (n, V) logits.

Rank r holds logits z[:, V_r] for its vocabulary range. With m = max_v z (all-reduce max),
  loss_i = log sum_v exp(z_iv - m_i) - (z_{i,t_i} - m_i)
where the sum-exp and the target logit are each a sum of per-rank pieces (one all-reduce of both).
Backward is local: dL/dz_iv = g_i * (softmax_iv - [v == t_i]) on the rank owning column v.
Statistics are fp32; padded vocabulary columns are masked to -inf; ignore_index targets give loss 0.
"""
from __future__ import annotations

import torch

from parallel3d.kernels import dispatch
from parallel3d import comm
from parallel3d.comm import Group


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, real_cols, ignore_index):
        z = logits.float()  # (n, v/tp)
        if real_cols < z.shape[-1]:
            z = z.clone()
            z[:, real_cols:] = float("-inf")
        m = z.max(dim=-1).values  # (n,)
        comm.all_reduce(m, group, op="max")
        z = z - m[:, None]
        exp = z.exp()  # (n, v/tp)
        local_t = target - vocab_start
        owned = (local_t >= 0) & (local_t < real_cols) & (target != ignore_index)
        idx = torch.where(owned, local_t, torch.zeros_like(local_t))
        picked = torch.where(owned, z.gather(-1, idx[:, None]).squeeze(-1), torch.zeros_like(m))  # (n,)
        both = torch.stack([exp.sum(-1), picked])  # (2, n): one all-reduce for both sums
        comm.all_reduce(both, group)
        sumexp, picked = both[0], both[1]
        valid = target != ignore_index
        loss = torch.where(valid, sumexp.log() - picked, torch.zeros_like(picked))
        softmax = exp / sumexp[:, None]
        ctx.save_for_backward(softmax, idx, owned, valid)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, idx, owned, valid = ctx.saved_tensors
        grad = softmax
        grad[torch.arange(grad.shape[0]), idx] -= owned.float()
        grad = grad * (g * valid)[:, None]
        return grad.to(ctx.dtype), None, None, None, None, None


IGNORE_INDEX = -100  # targets that take no loss (Hugging Face's and torch's convention)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: Group, vocab_start: int,
                                 real_cols: int, ignore_index: int = IGNORE_INDEX, backend: str = "torch") -> torch.Tensor:
    """logits (n, v/tp) this rank's vocabulary columns [vocab_start, vocab_start + real_cols) plus padding;
    target (n,) global ids -> per-token loss (n,) fp32. backend "triton"/"auto" on CUDA: the chunked
    kernel (never an fp32 softmax of the whole shard), with this module's TP all-reduces plugged in."""
    if dispatch.use_triton(backend, logits):
        real = logits[:, :real_cols]  # padding columns are not part of the vocabulary
        return dispatch.vocab_parallel_cross_entropy(
            real if real_cols == logits.shape[1] else real.contiguous(), target, vocab_start, ignore_index,
            lambda t: comm.all_reduce(t, group, op="max"), lambda t: comm.all_reduce(t, group), backend=backend)
    return _VocabParallelCE.apply(logits, target, group, vocab_start, real_cols, ignore_index)
