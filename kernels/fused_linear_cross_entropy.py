"""Chunked fused linear + cross-entropy: loss = CE(hidden @ weight.T, target) without the full logits.

Why: for n = 16k tokens and a 128k vocabulary the bf16 logits alone are 4 GiB (and their gradient as
much again). Processing `chunk` rows at a time keeps one (chunk, v) logits block alive.

Two forms, the same maths (the gradient maths sits above `_softmax_grad_`):
  reduction="sum" (what the model's head uses: its loss is the sum of the token losses): the scalar
    sum, with the gradients computed in the forward, chunk by chunk, while each chunk's logits are live
    (Liger-Kernel's idea): logits -> lse -> d logits in place -> d hidden rows and d weight += ... .
    The backward only scales them by the incoming scalar. Matmuls: 3 per chunk, as many as the unfused
    head (forward logits, backward d hidden and d weight), none recomputed.
  reduction="none": per-token losses (n,) for an arbitrary per-token dloss. The forward keeps only the
    per-row lse; the backward recomputes each chunk's logits (one extra (chunk, h) x (h, v) matmul per
    chunk, 4 instead of 3 in all), turns them into d logits in place and contracts them at once (5 under a
    pipeline's split backward, whose two passes each form only the gradient they want: `_gradient_wanted`).

Peak extra memory: the (v, h) d weight accumulator (fp32 for 16-bit weights, as in the unfused head's
backward) + one (chunk, v) logits block in the hidden dtype (the CE kernels write d logits over it) +
d hidden (n, h). Under reduction="sum" the accumulator and d hidden are allocated in the forward and held
until the backward (right after it on the last pipeline stage under 1F1B; a schedule that runs several
forwards of the head before their backwards, gpipe, holds one accumulator per microbatch in flight).
Chunk rows (`head_chunk_rows`): h / 2, so the 16-bit chunk logits are a quarter of the fp32 accumulator
the head holds anyway, and each chunk's d weight GEMM has K = chunk rows (2048 at Llama-3 8B) rather than
256: every chunk reads and writes the whole (v, h) fp32 accumulator once (4 v h bytes each way), which at
256-row chunks cost more than the matmuls.
The chunk loop is torch-level; the per-chunk statistics / gradient use the Triton CE kernels when
`use_triton` and the torch twins otherwise, so the CPU path has the same memory behaviour. On CUDA the
d weight GEMM accumulates straight into the fp32 accumulator (`addmm(..., out_dtype=float32)`: 16-bit
operands on the tensor cores, fp32 C read and written in the epilogue), with no (v, h) 16-bit temporary.
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


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


TWIN_ROWS = 256  # the torch path's row block for its fp32 temporaries (the Triton path needs none)
_FP32_OUT_ADDMM: dict = {}


def _fp32_out_addmm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this device's addmm takes `dtype` (16-bit) operands into an fp32 output in place (CUDA in
    recent torch; asked once per device type and dtype on tiny tensors, one host read then). On `meta`, the
    planner's stand-in for CUDA, the op running at all is the answer (it has no value to read), so the dry
    run takes the path CUDA takes."""
    key = (device.type, dtype)
    if key not in _FP32_OUT_ADDMM:
        try:
            c = torch.ones(2, 2, device=device)
            a = torch.ones(2, 2, device=device, dtype=dtype)
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)  # C aliased: accumulates, 1 + 2
            _FP32_OUT_ADDMM[key] = device.type == "meta" or bool(c[0, 0].item() == 3.0)
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT_ADDMM[key] = False
    return _FP32_OUT_ADDMM[key]


def _accumulate_dweight(dweight: torch.Tensor, dlogits: torch.Tensor, hidden: torch.Tensor,
                        use_triton: bool) -> None:
    """dweight (v, h) += dlogits^T (v, c) @ hidden (c, h), in the accumulator's dtype."""
    if dweight.dtype == dlogits.dtype:  # fp32 / fp64: in place, no temporary
        dweight.addmm_(dlogits.t(), hidden)
    elif use_triton and _fp32_out_addmm(dweight.device, dlogits.dtype):  # 16-bit operands, fp32 C (epilogue)
        torch.addmm(dweight, dlogits.t(), hidden, out_dtype=dweight.dtype, out=dweight)
    elif use_triton:  # older torch on the GPU: tensor-core product (a (v, h) temporary), added in fp32
        dweight.add_(dlogits.t() @ hidden)
    else:  # 16-bit elsewhere: fp32 products straight into the accumulator, TWIN_ROWS rows at a time
        for r in range(0, dlogits.shape[0], TWIN_ROWS):  # ((TWIN_ROWS, v) fp32 temporary, not (c, v))
            rows = slice(r, r + TWIN_ROWS)
            dweight.addmm_(dlogits[rows].t().to(dweight.dtype), hidden[rows].to(dweight.dtype))


def _chunk_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, ignore_index: int,
                 use_triton: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(local max, local sum-exp, local target logit), each (c,), of one chunk's logits shard (c, v_local)."""
    if use_triton:
        return cross_entropy_partial_stats(logits, target, vocab_start, ignore_index)
    blocks = [cross_entropy_partial_stats_reference(logits[r:r + TWIN_ROWS], target[r:r + TWIN_ROWS], vocab_start,
                                                    ignore_index)
              for r in range(0, logits.shape[0], TWIN_ROWS)]  # fp32 temporaries of (TWIN_ROWS, v) at most
    return tuple(torch.cat(parts) for parts in zip(*blocks))


def _combine(local_max: torch.Tensor, sumexp: torch.Tensor, tlogit: torch.Tensor, all_reduce_max: Reduce,
             all_reduce_sum: Reduce) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row statistics of the vocab shards -> (lse, target logit) over the whole vocabulary (rows,)."""
    if all_reduce_max is not None:
        gmax = all_reduce_max(local_max.clone())  # (rows,)
        sumexp, tlogit = all_reduce_sum(torch.stack([sumexp * torch.exp(local_max - gmax), tlogit]))
        local_max = gmax
    return local_max + torch.log(sumexp), tlogit


# Gradient of loss_r = lse_r - x_{r, t_r} (x = hidden @ weight.T, (n, v); t_r the target, ignored rows
# have loss 0) for an incoming per-row dloss_r:
#   d x_rj      = dloss_r * (softmax_rj - [j == t_r])            (softmax_rj = exp(x_rj - lse_r))
#   d hidden    = d x @ weight                    (n, v) @ (v, h) -> (n, h)
#   d weight    = d x^T @ hidden                  (v, n) @ (n, h) -> (v, h), summed over the row chunks
# A vocab shard (TP) uses the global lse and only the rank owning t_r subtracts the one-hot; its d hidden
# is a partial sum over its vocabulary rows (the caller's TP region all-reduces it).
# With reduction="sum" every dloss_r is the one incoming scalar g, so the gradients are formed in the
# forward with dloss_r = 1 and scaled by g in the backward: d hidden = g * dh1, d weight = g * dw1.
def _softmax_grad_(logits: torch.Tensor, target: torch.Tensor, vocab_start: int, lse: torch.Tensor,
                   dloss: torch.Tensor, ignore_index: int, use_triton: bool) -> torch.Tensor:
    """d logits of one chunk (c, v_local), written over `logits` on the Triton path (no second buffer)."""
    if use_triton:
        return cross_entropy_partial_grad(logits, target, vocab_start, lse, dloss, ignore_index, out=logits)
    for r in range(0, logits.shape[0], TWIN_ROWS):  # the twin's fp32 temporary: (TWIN_ROWS, v), not (c, v)
        rows = slice(r, r + TWIN_ROWS)
        logits[rows] = cross_entropy_partial_grad_reference(logits[rows], target[rows], vocab_start, lse[rows],
                                                            dloss[rows], ignore_index)
    return logits


def _gradient_wanted(ctx, i: int) -> bool:
    """Whether the running backward wants input i's gradient (the engine will pass it on). A split backward
    (pipeline/backward.py) runs this node in its input pass (d hidden only) and its weight pass (d weight
    only): each then makes 2 matmuls a chunk, not 3. Leaves enter as views (the engine cannot answer for a
    leaf's own node under autograd.grad); where it cannot answer, the gradient is formed."""
    if not ctx.needs_input_grad[i]:
        return False
    node = ctx.next_functions[i][0]
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if node is None or will_execute is None:
        return True
    try:
        return bool(will_execute(node))
    except RuntimeError:  # a leaf's accumulator under autograd.grad
        return True


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """reduction="none": per-token loss (n,), differentiable w.r.t. hidden and weight; logits are recomputed
    chunk by chunk in backward.

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
        stats = torch.empty((3, n), dtype=_acc_dtype(hidden.dtype), device=hidden.device)  # max, sumexp, tlogit
        for start in range(0, n, chunk):
            sl = slice(start, min(start + chunk, n))
            logits = hidden[sl] @ weight.t()  # (c, v_local)
            for row, value in zip(stats, _chunk_stats(logits, target[sl], vocab_start, ignore_index, use_triton)):
                row[sl] = value
            del logits
        lse, tlogit = _combine(*stats, all_reduce_max, all_reduce_sum)  # (n,) each
        ctx.save_for_backward(hidden, weight, target, lse)
        ctx.args = (ignore_index, chunk, use_triton, vocab_start)
        return torch.where(target != ignore_index, lse - tlogit, torch.zeros_like(lse))

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        hidden, weight, target, lse = ctx.saved_tensors
        ignore_index, chunk, use_triton, vocab_start = ctx.args
        n = hidden.shape[0]
        need_h, need_w = _gradient_wanted(ctx, 0), _gradient_wanted(ctx, 1)
        dhidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None  # (n, h)
        dweight = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device) \
            if need_w else None  # (v_local, h)
        dloss = dloss.contiguous()
        for start in range(0, n, chunk):
            sl = slice(start, min(start + chunk, n))
            logits = hidden[sl] @ weight.t()  # (c, v_local) recomputed
            dlogits = _softmax_grad_(logits, target[sl], vocab_start, lse[sl], dloss[sl], ignore_index, use_triton)
            if need_h:
                torch.mm(dlogits, weight, out=dhidden[sl])  # (c, h)
            if need_w:
                _accumulate_dweight(dweight, dlogits, hidden[sl], use_triton)
            del logits, dlogits  # one (c, v) block alive at a time
        return (dhidden, dweight.to(weight.dtype) if need_w else None) + (None,) * 7


class FusedLinearCrossEntropySumFunction(torch.autograd.Function):
    """reduction="sum": the summed token loss (a scalar, fp32 / fp64), its gradients formed in the forward.

    need_h / need_w: which gradients to form (the wrapper passes False for both under no_grad or for inputs
    that need none: then the forward is the statistics pass alone). Vocab-parallel as the per-token form,
    except that the TP reductions run per chunk (each chunk's lse is needed before its d logits).
    The gradients are saved for backward, so autograd frees them as soon as the backward has run (and keeps
    them under retain_graph). Peak memory is the per-token form's, reached in the forward instead.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, ignore_index: int,
                chunk: int, use_triton: bool, vocab_start: int, all_reduce_max: Reduce,
                all_reduce_sum: Reduce, need_h: bool, need_w: bool) -> torch.Tensor:
        n = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        loss = torch.zeros((), dtype=acc, device=hidden.device)
        dhidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None  # (n, h)
        dweight = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device) \
            if need_w else None  # (v_local, h)
        ones = torch.ones(min(chunk, n), dtype=acc, device=hidden.device)  # dloss_r = 1 (ignored rows: 0 inside)
        for start in range(0, n, chunk):
            sl = slice(start, min(start + chunk, n))
            tgt = target[sl]
            logits = hidden[sl] @ weight.t()  # (c, v_local)
            lse, tlogit = _combine(*_chunk_stats(logits, tgt, vocab_start, ignore_index, use_triton),
                                   all_reduce_max, all_reduce_sum)  # (c,) each
            loss += torch.where(tgt != ignore_index, lse - tlogit, torch.zeros_like(lse)).sum()
            if need_h or need_w:
                dlogits = _softmax_grad_(logits, tgt, vocab_start, lse, ones[: sl.stop - sl.start],
                                         ignore_index, use_triton)  # (c, v_local), over the logits
                if need_h:
                    torch.mm(dlogits, weight, out=dhidden[sl])  # (c, h)
                if need_w:
                    _accumulate_dweight(dweight, dlogits, hidden[sl], use_triton)
                del dlogits
            del logits  # (the next chunk's logits must not meet this one's: one (c, v) block at a time)
        ctx.save_for_backward(dhidden, dweight)  # freed by the engine once the backward has run
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, dloss: torch.Tensor):
        dhidden, dweight = ctx.saved_tensors  # formed with dloss = 1: scale by the incoming scalar
        dloss = dloss.to(_acc_dtype(dloss.dtype))  # the scale stays fp32 (never rounded to 16 bits first)
        if dhidden is not None:  # (n, h), scaled in fp32; not in place: retain_graph may reuse it
            dhidden = torch.mul(dhidden.to(dloss.dtype), dloss,
                                out=torch.empty(dhidden.shape, dtype=dhidden.dtype, device=dhidden.device))
        if dweight is not None:  # (v, h): scaled in fp32 and cast in one pass
            dweight = torch.mul(dweight, dloss,
                                out=torch.empty(dweight.shape, dtype=ctx.weight_dtype, device=dweight.device))
        return (dhidden, dweight) + (None,) * 9


MIN_CHUNK_ROWS = 256  # below this the per-chunk (v, h) d weight accumulation costs more than the matmuls


def head_chunk_rows(rows: int, vocab: int, hidden: int) -> int:
    """Rows per chunk: hidden / 2, so one chunk's 16-bit logits (chunk, vocab) are a quarter of the fp32
    (vocab, hidden) d weight accumulator the head allocates anyway (its extra memory stays a fraction of a
    buffer it has), at least MIN_CHUNK_ROWS and at most `rows`. Every chunk adds its d weight into that
    accumulator, a pass over 4 vocab hidden bytes each way, which only pays off against a matmul with
    enough rows (K = chunk): 2048 rows at Llama-3 8B (4 chunks of 8192 tokens) rather than 256 (32 chunks,
    32 passes over the 2 GiB accumulator). A multiple of 8 (tensor-core friendly). `vocab` is unused (kept
    for callers): the rule is relative to the accumulator, whose size already scales with it."""
    del vocab
    per = min(max(hidden // 2, MIN_CHUNK_ROWS), max(rows, 1))
    return -(-per // 8) * 8


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               ignore_index: int = -100, chunk: Optional[int] = None,
                               use_triton: Optional[bool] = None, vocab_start: int = 0,
                               all_reduce_max: Reduce = None, all_reduce_sum: Reduce = None,
                               reduction: str = "none") -> torch.Tensor:
    """CE(hidden @ weight.T, target), `chunk` rows at a time: per-token loss (n,) fp32 (fp64 for fp64 inputs)
    with reduction="none", their sum (a scalar) with reduction="sum" (gradients formed in the forward).

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
    args = (hidden, weight, target, ignore_index, chunk, use_triton, vocab_start, all_reduce_max, all_reduce_sum)
    if reduction == "none":  # leaves enter as views: their node can say which gradients a backward wants
        leaf_view = lambda t: t.view_as(t) if t.requires_grad and t.grad_fn is None else t  # noqa: E731
        return FusedLinearCrossEntropyFunction.apply(leaf_view(hidden), leaf_view(weight), *args[2:])
    if reduction == "sum":
        grad = torch.is_grad_enabled()
        return FusedLinearCrossEntropySumFunction.apply(*args, grad and hidden.requires_grad,
                                                        grad and weight.requires_grad)
    raise ValueError(f"reduction must be 'none' or 'sum', got {reduction!r}")
