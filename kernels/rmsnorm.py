"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, optionally fused with the residual add before it.

Why fused: in a pre-norm transformer every block does `h = h + f(x); x = norm(h)`. Doing the add inside
the norm kernel reads x and the residual once and writes both outputs in one pass instead of three.

Numerics follow Hugging Face Llama (the torch reference): statistics in fp32, the normalised value rounded
to the input dtype before the weight multiply, output dtype = promote(x.dtype, weight.dtype).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from parallel3d.kernels._triton_utils import acc_dtype, cdiv, next_pow2, num_programs_hint, rows_2d, tl_dtype


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., h), weight (h,) -> (..., h) in x.dtype; statistics in fp32 (as Hugging Face Llama)."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)  # (..., 1)
    return weight * (x32 * rstd).to(x.dtype)


def rmsnorm_residual_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual) with new_residual = x + residual (promoted dtype), normed = rmsnorm of it."""
    new_residual = x + residual  # (..., h)
    return rmsnorm_reference(new_residual, weight, eps), new_residual


@triton.jit
def _rmsnorm_fwd_kernel(X, R, W, Y, S, RSTD, stride_x, stride_r, stride_y, stride_s, n_cols, eps,
                        HAS_RES: tl.constexpr, NORM_DTYPE: tl.constexpr, ACC: tl.constexpr,
                        BLOCK: tl.constexpr):
    """One program per row: (optionally) s = x + r, then y = round(s * rstd) * w."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK,)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK,)
        s = (x + r).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, s, mask=mask)
        x = s.to(ACC)  # normalise the rounded sum, exactly what the unfused path sees
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)  # scalar
    tl.store(RSTD + row, rstd)
    w = tl.load(W + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK,)
    xhat = (x * rstd).to(NORM_DTYPE).to(ACC)
    tl.store(Y + row * stride_y + cols, (xhat * w).to(Y.dtype.element_ty), mask=mask)


# Backward. With xhat = x * rstd, rstd = (mean(x^2) + eps)^(-1/2), y = w * xhat and g = dy * w:
#   dx = rstd * (g - xhat * mean(g * xhat))          (d rstd / dx = -rstd^3 x / n gives the mean term)
#   dw = sum_rows dy * xhat
#   fused residual: s = x + r feeds both outputs, so dx = dr = (the above) + d(new_residual).
# dw is reduced without atomics: each program owns a contiguous block of rows and writes one fp32
# partial row to DW_PART (programs, h); the host then sums the few partial rows (second reduction).
@triton.jit
def _rmsnorm_bwd_kernel(DY, X, W, RSTD, DS, DX, DW_PART, stride_dy, stride_x, stride_ds, stride_dx,
                        n_rows, n_cols, rows_per_prog, HAS_DS: tl.constexpr, NORM_DTYPE: tl.constexpr,
                        ACC: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK,)
    dw = tl.zeros((BLOCK,), dtype=ACC)
    row_start = pid * rows_per_prog
    row_end = tl.minimum(row_start + rows_per_prog, n_rows)
    first = row_start.to(tl.int64)  # pointers advance row by row: 64-bit offsets, no overflow
    x_ptr, dy_ptr, ds_ptr, dx_ptr = (X + first * stride_x, DY + first * stride_dy, DS + first * stride_ds,
                                     DX + first * stride_dx)
    rstd_ptr = RSTD + first
    for _ in range(row_start, row_end):
        x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK,)
        dy = tl.load(dy_ptr + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK,)
        rstd = tl.load(rstd_ptr).to(ACC)
        xhat = x * rstd
        g = dy * w
        dx = rstd * (g - xhat * (tl.sum(g * xhat, axis=0) / n_cols))  # (BLOCK,)
        if HAS_DS:
            dx += tl.load(ds_ptr + cols, mask=mask, other=0.0).to(ACC)
        tl.store(dx_ptr + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat.to(NORM_DTYPE).to(ACC)
        x_ptr += stride_x
        dy_ptr += stride_dy
        ds_ptr += stride_ds
        dx_ptr += stride_dx
        rstd_ptr += 1
    tl.store(DW_PART + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


def _num_warps(block: int) -> int:
    return int(min(max(block // 256, 1), 16))


def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Launch the forward kernel. Returns (y (..., h), new_residual (..., h) or None, rstd (rows,))."""
    h = x.shape[-1]
    x2 = rows_2d(x)  # (n, h)
    n = x2.shape[0]
    norm_in_dtype = x.dtype
    r2, s2 = x2, x2  # placeholders when there is no residual (never read or written)
    if residual is not None:
        r2 = rows_2d(residual)  # (n, h)
        norm_in_dtype = torch.promote_types(x.dtype, residual.dtype)
        s2 = torch.empty((n, h), dtype=norm_in_dtype, device=x.device)  # (n, h)
    y2 = torch.empty((n, h), dtype=torch.promote_types(norm_in_dtype, weight.dtype), device=x.device)
    acc = acc_dtype(x.dtype, norm_in_dtype, weight.dtype)
    rstd = torch.empty(n, dtype=torch.float64 if acc == tl.float64 else torch.float32, device=x.device)  # (n,)
    block = next_pow2(h)
    if n > 0:
        _rmsnorm_fwd_kernel[(n,)](
            x2, r2, weight, y2, s2, rstd, x2.stride(0), r2.stride(0), y2.stride(0), s2.stride(0), h, eps,
            HAS_RES=residual is not None, NORM_DTYPE=tl_dtype(norm_in_dtype),
            ACC=acc, BLOCK=block, num_warps=_num_warps(block))
    new_res = s2.view(x.shape) if residual is not None else None
    return y2.view(x.shape), new_res, rstd


def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                     d_residual_out: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel. x is the normalised input (the new residual when fused).
    Returns (dx (..., h) in x.dtype, dw (h,) in weight.dtype)."""
    h = x.shape[-1]
    x2, dy2 = rows_2d(x), rows_2d(dy)  # (n, h)
    n = x2.shape[0]
    ds2 = rows_2d(d_residual_out) if d_residual_out is not None else dy2  # (n, h)
    dx2 = torch.empty((n, h), dtype=x.dtype, device=x.device)  # (n, h)
    progs = max(min(num_programs_hint(x.device), n), 1)
    rows_per_prog = cdiv(n, progs)
    acc = acc_dtype(x.dtype, weight.dtype)
    dw_part = torch.zeros((progs, h), dtype=torch.float64 if acc == tl.float64 else torch.float32,
                          device=x.device)  # (programs, h)
    block = next_pow2(h)
    if n > 0:
        _rmsnorm_bwd_kernel[(progs,)](
            dy2, x2, weight, rstd, ds2, dx2, dw_part, dy2.stride(0), x2.stride(0), ds2.stride(0),
            dx2.stride(0), n, h, rows_per_prog, HAS_DS=d_residual_out is not None,
            NORM_DTYPE=tl_dtype(x.dtype), ACC=acc, BLOCK=block, num_warps=_num_warps(block))
    return dx2.view(x.shape), dw_part.sum(0).to(weight.dtype)


class RMSNormFunction(torch.autograd.Function):
    """Differentiable w.r.t. x and weight."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, _, rstd = rmsnorm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rmsnorm_backward(dy, x, weight, rstd)
        return dx, dw, None


class RMSNormResidualFunction(torch.autograd.Function):
    """Differentiable w.r.t. x, residual and weight; the new residual is an output with its own grad."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
        y, s, rstd = rmsnorm_forward(x, weight, eps, residual=residual)
        ctx.save_for_backward(s, weight, rstd)
        ctx.dtypes = (x.dtype, residual.dtype)
        return y, s

    @staticmethod
    def backward(ctx, dy: Optional[torch.Tensor], ds: Optional[torch.Tensor]):
        s, weight, rstd = ctx.saved_tensors
        if dy is None:
            dy = torch.zeros_like(s)
        dsum, dw = rmsnorm_backward(dy, s, weight, rstd, d_residual_out=ds)
        return dsum.to(ctx.dtypes[0]), dsum.to(ctx.dtypes[1]), dw, None


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton RMSNorm, x (..., h), weight (h,). Same semantics as `rmsnorm_reference`."""
    return RMSNormFunction.apply(x, weight, eps)


def rmsnorm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton fused residual add + RMSNorm -> (normed, new_residual); see `rmsnorm_residual_reference`."""
    return RMSNormResidualFunction.apply(x, residual, weight, eps)
