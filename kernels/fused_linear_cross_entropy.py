"""Chunked fused linear + cross-entropy: loss = CE(hidden @ weight.T, target) without the full logits.

Why: for n = 16k tokens and a 128k vocabulary the bf16 logits alone are 4 GiB (and their gradient as
much again). Processing `chunk` rows at a time keeps one (chunk, v) logits block alive: forward keeps
only the per-row lse; backward recomputes each chunk's logits, turns them into d logits with the CE
kernel, and immediately contracts them into d hidden and d weight (fp32 accumulator).

Peak extra memory: chunk * v logits + chunk * v grad (in the hidden dtype) + an fp32 (v, h) accumulator
for d weight. Cost: one extra (chunk, h) x (h, v) matmul per chunk in backward (the recomputation).
The chunk loop is torch-level; the per-chunk loss/grad uses the Triton CE kernels when `use_triton`
and the torch twins otherwise, so the CPU path has the same memory behaviour.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from parallel3d.kernels.cross_entropy import (cross_entropy_partial_grad, cross_entropy_partial_grad_reference,
                                   cross_entropy_partial_stats, cross_entropy_partial_stats_reference,
                                   cross_entropy_reference)


def fused_linear_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                                         ignore_index: int = -100) -> torch.Tensor:
    """hidden (n, h), weight (v, h), target (n,) -> per-token loss (n,) fp32 (materialises logits)."""
    return cross_entropy_reference(hidden @ weight.t(), target, ignore_index)


Reduce = Optional[Callable[[torch.Tensor], torch.Tensor]]


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Differentiable w.r.t. hidden and weight; logits are recomputed chunk by chunk in backward.

    Vocab-parallel: weight holds vocab rows [vocab_start, vocab_start + v_local); the per-row statistics of
    all chunks are reduced over the TP group with one MAX and one SUM all-reduce at the end (see
    kernels.cross_entropy). d hidden is then this rank's partial sum: the caller's TP region mapping
    all-reduces it in backward, as for any column-parallel linear.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                chunk: int, use_triton: bool, vocab_start: int, all_reduce_max: Reduce,
                all_reduce_sum: Reduce) -> torch.Tensor:
        n = hidden.shape[0]
        stat_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        stats = torch.empty((3, n), dtype=stat_dtype, device=hidden.device)  # (3, n) max, sumexp, target logit
        stats_fn = cross_entropy_partial_stats if use_triton else cross_entropy_partial_stats_reference
        for start in range(0, n, chunk):
            sl = slice(start, min(start + chunk, n))
            logits = hidden[sl] @ weight.t()  # (c, v_local)
            for row, value in zip(stats, stats_fn(logits, target[sl], vocab_start, ignore_index)):
                row[sl] = value
        local_max, sumexp, tlogit = stats
        if all_reduce_max is not None:
            gmax = all_reduce_max(local_max.clone())  # (n,)
            sumexp, tlogit = all_reduce_sum(torch.stack([sumexp * torch.exp(local_max - gmax), tlogit]))
            local_max = gmax
        lse = local_max + torch.log(sumexp)  # (n,)
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.args = (ignore_index, chunk, use_triton, vocab_start)
        return torch.where(target != ignore_index, lse - tlogit, torch.zeros_like(lse))

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        hidden, weight, target, lse = ctx.saved_tensors
        ignore_index, chunk, use_triton, vocab_start = ctx.args
        grad_fn = cross_entropy_partial_grad if use_triton else cross_entropy_partial_grad_reference
        n = hidden.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dhidden = torch.empty_like(hidden) if need_h else None  # (n, h)
        dweight = torch.zeros(weight.shape, dtype=torch.float32 if weight.dtype != torch.float64
                              else torch.float64, device=weight.device) if need_w else None  # (v_local, h)
        for start in range(0, n, chunk):
            sl = slice(start, min(start + chunk, n))
            logits = hidden[sl] @ weight.t()  # (c, v_local) recomputed
            dlogits = grad_fn(logits, target[sl], vocab_start, lse[sl], dloss[sl], ignore_index)  # (c, v_local)
            if need_h:
                dhidden[sl] = dlogits @ weight  # (c, h)
            if need_w:  # (v_local, h) += dlogits^T (v_local, c) @ hidden (c, h)
                if dweight.dtype == weight.dtype:  # fp32 / fp64: in place, no temporary
                    dweight.addmm_(dlogits.t(), hidden[sl])
                elif use_triton:  # 16-bit on the GPU: tensor-core product (a (v, h) temporary), added in fp32
                    dweight.add_(dlogits.t() @ hidden[sl])
                else:  # 16-bit elsewhere: fp32 product straight into the accumulator ((c, v) fp32 temporary)
                    dweight.addmm_(dlogits.t().float(), hidden[sl].float())
        return (dhidden, dweight.to(weight.dtype) if need_w else None) + (None,) * 7


MIN_CHUNK_ROWS = 256  # below this the per-chunk (v, h) d weight accumulation costs more than the matmuls


def head_chunk_rows(rows: int, vocab: int, hidden: int) -> int:
    """Rows per chunk: enough chunks that one chunk's logits (chunk, vocab) hold about as many elements as
    the hidden input (rows, hidden), so the head's extra memory stays at the size of an activation it has
    anyway, but at least MIN_CHUNK_ROWS: every chunk adds its d weight into the (vocab, hidden)
    accumulator, a pass over vocab * hidden that only pays off against a matmul of enough rows.
    A multiple of 8 (tensor-core friendly)."""
    chunks = max(1, -(-vocab // max(hidden, 1)))
    per = max(-(-rows // chunks), MIN_CHUNK_ROWS)
    return -(-per // 8) * 8


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               ignore_index: int = -100, chunk: Optional[int] = None,
                               use_triton: Optional[bool] = None, vocab_start: int = 0,
                               all_reduce_max: Reduce = None, all_reduce_sum: Reduce = None) -> torch.Tensor:
    """Per-token loss (n,) fp32 (fp64 for fp64 inputs) of CE(hidden @ weight.T, target), `chunk` rows at a time.

    hidden (..., h) is flattened to (n, h); weight (v, h) is the output embedding; target (n,).
    use_triton: None -> Triton CE kernels on CUDA, torch elsewhere.
    Vocab-parallel: pass this rank's weight shard, its vocab_start and the TP-group all-reduces (tensor ->
    reduced tensor, MAX and SUM); the loss is then the full-vocabulary loss on every rank.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    target = target.reshape(-1)
    if use_triton is None:
        use_triton = hidden.is_cuda
    if chunk is None:
        chunk = head_chunk_rows(hidden.shape[0], weight.shape[0], hidden.shape[1])
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if (all_reduce_max is None) != (all_reduce_sum is None):
        raise ValueError("pass both all_reduce_max and all_reduce_sum (vocab-parallel) or neither")
    return FusedLinearCrossEntropyFunction.apply(hidden, weight, target, ignore_index, chunk, use_triton,
                                                 vocab_start, all_reduce_max, all_reduce_sum)
