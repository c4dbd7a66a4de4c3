"""The Triton kernels as `torch.library` custom ops (namespace `parallel3d`), each with a fake implementation.

Why: an autograd.Function that launches Triton directly is opaque to FakeTensorMode, the meta device and
torch.compile (a graph break, or a crash on fake tensors). As custom ops the launches are single graph
nodes with fake implementations (shapes without running anything) and autograd registered on the op, so
a compiled graph holds forward and backward ops. kernels.dispatch calls these wrappers when it picks Triton.

Eager calls skip the custom-op layer and its host time (`direct`: real tensors, nothing compiling or
watching; RESULTS.md, "Host cost of our kernel ops"): a wrapper calls the kernel module's own entry, the
same launchers and gradients. Whoever watches (torch.compile, the meta dry run and its StepTracker,
FakeTensorMode, the profiler step_profile.py reads op names from) gets the custom ops.

Ops (forward ones differentiable):
  rmsnorm(x, w, eps) -> y      rmsnorm_residual(x, r, w, eps) -> (y, x + r)     swiglu(gate, up) -> y
  rope(q, k, cos, sin) -> (q', k')     flash_attention(q, k, v, causal, scale) -> (out, lse)
  grouped_mm(x, w, counts) -> y        ce_partial_stats / ce_partial_grad (not differentiated)
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op
from torch.utils.flop_counter import register_flop_formula

from parallel3d.kernels import cross_entropy as _ce
from parallel3d.kernels import flash_attention as _fa
from parallel3d.kernels import grouped_gemm as _gg
from parallel3d.kernels import rmsnorm as _rn
from parallel3d.kernels import rope as _rp
from parallel3d.kernels import swiglu as _sw
from parallel3d.kernels._triton_utils import direct
from parallel3d.kernels.flash_attention import attention_bwd_flops, attention_fwd_flops


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _rows(x: Tensor) -> int:
    return x.numel() // max(x.shape[-1], 1)


# ---- RMSNorm ------------------------------------------------------------------------------------------
@custom_op("parallel3d::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    y, _, rstd = _rn.rmsnorm_forward(x, weight, eps)
    return y, rstd


@rmsnorm_fwd.register_fake
def _(x, weight, eps):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
    return y, x.new_empty((_rows(x),), dtype=_stat_dtype(torch.promote_types(x.dtype, weight.dtype)))


@custom_op("parallel3d::rmsnorm_res_fwd", mutates_args=())
def rmsnorm_res_fwd(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    return _rn.rmsnorm_forward(x, weight, eps, residual=residual)


@rmsnorm_res_fwd.register_fake
def _(x, residual, weight, eps):
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    y = x.new_empty(x.shape, dtype=torch.promote_types(s_dtype, weight.dtype))
    rstd = x.new_empty((_rows(x),), dtype=_stat_dtype(torch.promote_types(s_dtype, weight.dtype)))
    return y, x.new_empty(x.shape, dtype=s_dtype), rstd


@custom_op("parallel3d::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, ds: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    return _rn.rmsnorm_backward(dy, x, weight, rstd, d_residual_out=ds)


@rmsnorm_bwd.register_fake
def _(dy, x, weight, rstd, ds):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rmsnorm_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rmsnorm_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rmsnorm_bwd(dy, x, weight, rstd, None)
    return dx, dw, None


rmsnorm_fwd.register_autograd(_rmsnorm_backward, setup_context=_rmsnorm_setup)


def _rmsnorm_res_setup(ctx, inputs, output):
    x, residual, weight, _ = inputs
    ctx.save_for_backward(output[1], weight, output[2])
    ctx.dtypes = (x.dtype, residual.dtype)


def _rmsnorm_res_backward(ctx, dy, ds, _drstd):
    s, weight, rstd = ctx.saved_tensors
    dsum, dw = rmsnorm_bwd(dy, s, weight, rstd, ds)
    return dsum.to(ctx.dtypes[0]), dsum.to(ctx.dtypes[1]), dw, None


rmsnorm_res_fwd.register_autograd(_rmsnorm_res_backward, setup_context=_rmsnorm_res_setup)


def rmsnorm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    if direct(x, weight):
        return _rn.rmsnorm(x, weight, eps)
    return rmsnorm_fwd(x, weight, eps)[0]


def rmsnorm_residual(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if direct(x, residual, weight):
        return _rn.rmsnorm_residual(x, residual, weight, eps)
    y, s, _ = rmsnorm_res_fwd(x, residual, weight, eps)
    return y, s


# ---- SwiGLU -------------------------------------------------------------------------------------------
@custom_op("parallel3d::swiglu", mutates_args=())
def swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    return _sw.swiglu_forward(gate, up)


@swiglu_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


@custom_op("parallel3d::swiglu_bwd", mutates_args=())
def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return _sw.swiglu_backward(dy, gate, up)


@swiglu_bwd.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


swiglu_op.register_autograd(lambda ctx, dy: swiglu_bwd(dy, *ctx.saved_tensors), setup_context=_swiglu_setup)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    if direct(gate, up):
        return _sw.swiglu(gate, up)
    return swiglu_op(gate, up)


# ---- RoPE ---------------------------------------------------------------------------------------------
@custom_op("parallel3d::rope", mutates_args=())
def rope_op(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backward: bool) -> tuple[Tensor, Tensor]:
    return _rp.rope_apply(q, k, cos, sin, backward=backward)


@rope_op.register_fake
def _(q, k, cos, sin, backward):
    return q.new_empty(q.shape), k.new_empty(k.shape)


def _rope_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2], inputs[3])


def _rope_backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    dq_in, dk_in = rope_op(dq, dk, cos, sin, True)
    return dq_in, dk_in, None, None, None


rope_op.register_autograd(_rope_backward, setup_context=_rope_setup)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    if direct(q, k, cos, sin):
        return _rp.rope(q, k, cos, sin)
    return rope_op(q, k, cos, sin, False)


# ---- flash attention ----------------------------------------------------------------------------------
@custom_op("parallel3d::flash_attention_fwd", mutates_args=())
def flash_attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float]
                        ) -> tuple[Tensor, Tensor]:
    return _fa.flash_attention_forward(q, k, v, causal, scale)


@flash_attention_fwd.register_fake
def _(q, k, v, causal, scale):
    b, sq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=_stat_dtype(q.dtype))


@custom_op("parallel3d::flash_attention_bwd", mutates_args=())
def flash_attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                        scale: Optional[float], dlse: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    return _fa.flash_attention_backward(do, q, k, v, out, lse, causal, scale, dlse)


@flash_attention_bwd.register_fake
def _(do, q, k, v, out, lse, causal, scale, dlse):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fa_setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.args = (causal, scale)


def _fa_backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = flash_attention_bwd(dout, q, k, v, out, lse, *ctx.args, dlse)
    return dq, dk, dv, None, None


flash_attention_fwd.register_autograd(_fa_backward, setup_context=_fa_setup)


# registered undecorated, so the plain formulas stay importable (register_flop_formula returns a wrapper)
register_flop_formula(torch.ops.parallel3d.flash_attention_fwd)(attention_fwd_flops)
register_flop_formula(torch.ops.parallel3d.flash_attention_bwd)(attention_bwd_flops)


def flash_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: Optional[float] = None
                    ) -> tuple[Tensor, Tensor]:
    if direct(q, k, v):
        return _fa.flash_attention(q, k, v, causal, scale)
    return flash_attention_fwd(q, k, v, causal, scale)


# ---- grouped GEMM -------------------------------------------------------------------------------------
@custom_op("parallel3d::grouped_mm", mutates_args=())
def grouped_mm_op(x: Tensor, weight: Tensor, counts: list[int], transpose_b: bool) -> Tensor:
    return _gg.grouped_mm_forward(x, weight, counts, transpose_b)


@grouped_mm_op.register_fake
def _(x, weight, counts, transpose_b):
    return x.new_empty((x.shape[0], weight.shape[1] if transpose_b else weight.shape[2]))


@custom_op("parallel3d::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(dy: Tensor, x: Tensor, counts: list[int]) -> Tensor:
    return _gg.grouped_mm_weight_grad(dy, x, counts)


@grouped_mm_wgrad.register_fake
def _(dy, x, counts):
    return x.new_empty((len(counts), dy.shape[1], x.shape[1]))


def _gmm_setup(ctx, inputs, output):
    x, weight, counts, _ = inputs
    ctx.save_for_backward(x, weight)
    ctx.counts = counts


def _gmm_backward(ctx, dy):
    x, weight = ctx.saved_tensors
    return grouped_mm_op(dy, weight, ctx.counts, False), grouped_mm_wgrad(dy, x, ctx.counts), None, None


grouped_mm_op.register_autograd(_gmm_backward, setup_context=_gmm_setup)


def grouped_mm(x: Tensor, weight: Tensor, counts: list[int]) -> Tensor:
    """x (N, K) rows sorted by expert, weight (E, M, K) -> (N, M); differentiable."""
    if direct(x, weight):
        return _gg.grouped_mm(x, weight, counts)
    return grouped_mm_op(x, weight, [int(c) for c in counts], True)


# ---- cross-entropy pieces (used inside the fused head's and the vocab-parallel loss's Functions) -------
@custom_op("parallel3d::ce_partial_stats", mutates_args=())
def ce_partial_stats(logits: Tensor, target: Tensor, vocab_start: int, ignore_index: int) -> Tensor:
    """(3, n): local max, local sum-exp, local target logit (see kernels.cross_entropy)."""
    return torch.stack(_ce.cross_entropy_partial_stats(logits, target, vocab_start, ignore_index))


@ce_partial_stats.register_fake
def _(logits, target, vocab_start, ignore_index):
    return logits.new_empty((3, logits.shape[0]), dtype=_stat_dtype(logits.dtype))


@custom_op("parallel3d::ce_partial_grad", mutates_args=())
def ce_partial_grad(logits: Tensor, target: Tensor, vocab_start: int, lse: Tensor, grad_loss: Tensor,
                    ignore_index: int) -> Tensor:
    return _ce.cross_entropy_partial_grad(logits, target, vocab_start, lse, grad_loss, ignore_index)


@ce_partial_grad.register_fake
def _(logits, target, vocab_start, lse, grad_loss, ignore_index):
    return logits.new_empty(logits.shape)
