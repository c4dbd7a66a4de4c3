"""Token cross-entropy over a large, possibly partial (vocab-parallel) vocabulary.

Why a kernel: with a 128k vocabulary the eager path materialises fp32 copies of the whole (n, v) logits
(upcast, softmax, gradient). Here each row is streamed through in BLOCK_V chunks with an online
max / sum-exp, so only (n,) statistics are kept; backward recomputes softmax chunk by chunk from the
saved lse and writes the gradient directly in the logits dtype.

Vocab-parallel (tensor-parallel) loss. Rank r holds logits[:, start_r : start_r + v_r] and the global
target. `cross_entropy_partial_stats` returns per row, over the local shard only:
    local_max (n,), local_sumexp (n,) = sum exp(x - local_max), local_target_logit (n,) (0 if not owned)
The caller combines them over the TP group:
    gmax   = all_reduce(local_max, MAX)
    sumexp = all_reduce(local_sumexp * exp(local_max - gmax), SUM)
    tlogit = all_reduce(local_target_logit, SUM)         # exactly one rank owns each target
    lse    = gmax + log(sumexp);  loss = where(target != ignore_index, lse - tlogit, 0)
and in backward each rank calls `cross_entropy_partial_grad(local_logits, target, start_r, lse, dloss)`,
which needs no communication. `vocab_parallel_cross_entropy` packages exactly this, taking the two
all-reduces as callables so this package stays free of process groups.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import triton
import triton.language as tl

from parallel3d.kernels._triton_utils import acc_dtype, cdiv, interpreting, next_pow2


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
                            ) -> torch.Tensor:
    """logits (n, v), target (n,) -> per-token loss (n,) fp32, 0 where target == ignore_index."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    picked = logits.gather(-1, safe[:, None]).squeeze(-1)  # (n,)
    return torch.where(valid, lse - picked, torch.zeros_like(lse))


def cross_entropy_partial_stats_reference(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                          ignore_index: int = -100
                                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch twin of `cross_entropy_partial_stats`: (local_max, local_sumexp, local_target_logit) (n,)."""
    x = logits if logits.dtype == torch.float64 else logits.float()  # (n, v_local)
    local_max = x.max(dim=-1).values  # (n,)
    sumexp = torch.exp(x - local_max[:, None]).sum(-1)  # (n,)
    local_t = target - vocab_start
    owned = (target != ignore_index) & (local_t >= 0) & (local_t < x.shape[1])
    picked = x.gather(-1, torch.where(owned, local_t, torch.zeros_like(local_t))[:, None]).squeeze(-1)
    return local_max, sumexp, torch.where(owned, picked, torch.zeros_like(picked))


def cross_entropy_partial_grad_reference(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                         lse: torch.Tensor, grad_loss: torch.Tensor,
                                         ignore_index: int = -100) -> torch.Tensor:
    """Torch twin of `cross_entropy_partial_grad`: (softmax - onehot) * dloss on the local shard.

    One (n, v_local) temporary in the compute dtype (fp32, fp64 for fp64), updated in place, then cast to the
    logits dtype: the fused head calls this per chunk, so its peak is one fp32 chunk, not four."""
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(acc, copy=True)  # (n, v_local), never aliases the caller's logits
    valid = target != ignore_index
    dloss = torch.where(valid, grad_loss.to(acc), torch.zeros((), dtype=acc, device=x.device))  # (n,)
    x.sub_(lse.to(acc)[:, None]).exp_()  # softmax (n, v_local) from the global lse
    local_t = target - vocab_start
    owned = valid & (local_t >= 0) & (local_t < x.shape[1])  # (n,) rows whose target is on this shard
    rows = torch.arange(x.shape[0], device=x.device)
    x.index_put_((rows, torch.where(owned, local_t, 0)), -owned.to(acc), accumulate=True)  # - onehot
    return x.mul_(dloss[:, None]).to(logits.dtype)


@triton.jit
def _ce_stats_kernel(LOGITS, TARGET, MAX, SUMEXP, TGT, stride_row, n_cols, vocab_start, ignore_index,
                     ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    """One program per row: online max / sum-exp over the row in BLOCK_V chunks, plus the target logit."""
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_row
    m = tl.full([], float("-inf"), ACC)
    s = tl.zeros([], ACC)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        x = tl.load(ptr + cols, mask=cols < n_cols, other=float("-inf")).to(ACC)  # (BLOCK_V,)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: avoid inf - inf
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), axis=0)
        m = m_new
    t = tl.load(TARGET + row).to(tl.int64)
    local_t = t - vocab_start
    owned = (t != ignore_index) & (local_t >= 0) & (local_t < n_cols)
    tgt = tl.load(ptr + tl.where(owned, local_t, 0), mask=owned, other=0.0).to(ACC)
    tl.store(MAX + row, m)
    tl.store(SUMEXP + row, s)
    tl.store(TGT + row, tgt)


# Backward. loss = lse - x_t with lse = log sum_j exp(x_j), so per row
#   d loss / d x_j = softmax_j - [j == t] = exp(x_j - lse) - [j == t]
# times the incoming dloss (0 for ignored rows). With a vocab shard starting at vocab_start, lse is the
# global one and only the rank owning t subtracts the one-hot. Grid: (rows, vocab blocks).
@triton.jit
def _ce_grad_kernel(LOGITS, TARGET, LSE, DLOSS, DLOGITS, stride_row, stride_drow, n_cols, vocab_start,
                    ignore_index, ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
    mask = cols < n_cols
    t = tl.load(TARGET + row).to(tl.int64)
    dloss = tl.load(DLOSS + row).to(ACC)
    dloss = tl.where(t != ignore_index, dloss, 0.0)
    lse = tl.load(LSE + row).to(ACC)
    x = tl.load(LOGITS + row * stride_row + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK_V,)
    grad = tl.exp(x - lse) - tl.where(cols == t - vocab_start, 1.0, 0.0)  # (BLOCK_V,)
    tl.store(DLOGITS + row * stride_drow + cols, (grad * dloss).to(DLOGITS.dtype.element_ty), mask=mask)


def _block_v(n_cols: int, block_v: Optional[int]) -> int:
    if block_v is not None:
        return next_pow2(block_v)
    return min(next_pow2(n_cols), 1024 if interpreting() else 4096)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be (n, v), got {tuple(logits.shape)}")
    return logits if logits.stride(1) == 1 else logits.contiguous()


def cross_entropy_partial_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int = 0,
                                ignore_index: int = -100, block_v: Optional[int] = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton: logits shard (n, v_local), global target (n,) -> (local_max, local_sumexp,
    local_target_logit), each (n,) fp32 (fp64 for fp64 logits). See the module docstring to combine."""
    logits = _rows(logits)
    n, v = logits.shape
    stat_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = torch.empty((3, n), dtype=stat_dtype, device=logits.device)  # (3, n)
    if n > 0:
        block = _block_v(v, block_v)
        _ce_stats_kernel[(n,)](logits, target, out[0], out[1], out[2], logits.stride(0), v, vocab_start,
                               ignore_index, ACC=acc_dtype(logits.dtype), BLOCK_V=block,
                               num_warps=8 if block >= 2048 else 4)
    return out[0], out[1], out[2]


def cross_entropy_partial_grad(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                               lse: torch.Tensor, grad_loss: torch.Tensor, ignore_index: int = -100,
                               block_v: Optional[int] = None, out: Optional[torch.Tensor] = None
                               ) -> torch.Tensor:
    """Triton: d loss / d logits for a shard (n, v_local) given the global lse (n,) and dloss (n,).

    out: where to write it ((n, v_local), last dim contiguous); `out=logits` overwrites the logits in place
    (each element is read, then written, by the same program), which the fused head does with its
    per-chunk logits so that no second (chunk, v) buffer is allocated."""
    logits = _rows(logits)
    n, v = logits.shape
    grad = torch.empty_like(logits, memory_format=torch.contiguous_format) if out is None else out  # (n, v)
    if grad.shape != logits.shape or grad.stride(1) != 1:
        raise ValueError(f"out must be ({n}, {v}) with a contiguous last dim, got {tuple(grad.shape)}")
    if n > 0 and v > 0:
        block = _block_v(v, block_v)
        _ce_grad_kernel[(n, cdiv(v, block))](
            logits, target, lse.contiguous(), grad_loss.contiguous(), grad, logits.stride(0), grad.stride(0),
            v, vocab_start, ignore_index, ACC=acc_dtype(logits.dtype), BLOCK_V=block,
            num_warps=8 if block >= 2048 else 4)
    return grad


def _lse_and_loss(stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor], target: torch.Tensor,
                  ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    local_max, sumexp, tlogit = stats
    lse = local_max + torch.log(sumexp)  # (n,)
    return lse, torch.where(target != ignore_index, lse - tlogit, torch.zeros_like(lse))


class CrossEntropyFunction(torch.autograd.Function):
    """Per-token loss (n,) fp32; differentiable w.r.t. logits."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                block_v: Optional[int]) -> torch.Tensor:
        lse, loss = _lse_and_loss(cross_entropy_partial_stats(logits, target, 0, ignore_index, block_v),
                                  target, ignore_index)
        ctx.save_for_backward(logits, target, lse)
        ctx.ignore_index, ctx.block_v = ignore_index, block_v
        return loss

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        grad = cross_entropy_partial_grad(logits, target, 0, lse, dloss, ctx.ignore_index, ctx.block_v)
        return grad, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  block_v: Optional[int] = None) -> torch.Tensor:
    """Triton cross-entropy: logits (n, v), target (n,) -> loss (n,) fp32, as `cross_entropy_reference`."""
    return CrossEntropyFunction.apply(logits, target, ignore_index, block_v)


class VocabParallelCrossEntropyFunction(torch.autograd.Function):
    """Loss (n,) over a vocab shard; the all-reduces over the TP group are supplied by the caller."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, vocab_start: int, ignore_index: int,
                all_reduce_max: Callable[[torch.Tensor], torch.Tensor],
                all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        local_max, sumexp, tlogit = cross_entropy_partial_stats(logits, target, vocab_start, ignore_index)
        gmax = all_reduce_max(local_max.clone())  # (n,)
        sums = all_reduce_sum(torch.stack([sumexp * torch.exp(local_max - gmax), tlogit]))  # (2, n)
        lse, loss = _lse_and_loss((gmax, sums[0], sums[1]), target, ignore_index)
        ctx.save_for_backward(logits, target, lse)
        ctx.vocab_start, ctx.ignore_index = vocab_start, ignore_index
        return loss

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        grad = cross_entropy_partial_grad(logits, target, ctx.vocab_start, lse, dloss, ctx.ignore_index)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                 ignore_index: int, all_reduce_max: Callable[[torch.Tensor], torch.Tensor],
                                 all_reduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """Per-token loss (n,) fp32 from this rank's logits shard (n, v_local) and the global target (n,).

    all_reduce_max / all_reduce_sum reduce a tensor over the TP group and return the result (e.g.
    `lambda t: (dist.all_reduce(t, op=MAX, group=g), t)[1]`); identity functions give the tp=1 loss.
    The two values reduced with SUM travel in one collective. The returned loss is identical on all ranks.
    """
    return VocabParallelCrossEntropyFunction.apply(logits, target, vocab_start, ignore_index,
                                                   all_reduce_max, all_reduce_sum)
