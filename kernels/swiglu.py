"""SwiGLU activation: silu(gate) * up.

Why a kernel: eager PyTorch writes silu(gate) to memory and reads it back for the product, and autograd
keeps it alive for backward. The fused kernel reads gate and up once and writes one output; backward
recomputes the sigmoid from the saved inputs instead of storing intermediates.
gate/up are often the two halves of one fused projection, so the kernel takes a row stride and works on
such views without copying.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from parallel3d.kernels._triton_utils import acc_dtype, cdiv, next_pow2, rows_2d


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up (..., f) -> (..., f)."""
    return F.silu(gate) * up


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, stride_g, stride_u, stride_y, n_cols,
                       ACC: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (rows, column blocks): y = g * sigmoid(g) * u."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = cols < n_cols
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK,)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK,)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


# Backward, with sig = sigmoid(g) and silu(g) = g * sig:
#   d silu / dg = sig + g * sig * (1 - sig) = sig * (1 + g * (1 - sig))
#   dg = dy * u * sig * (1 + g * (1 - sig))
#   du = dy * g * sig
@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, n_cols,
                       ACC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = cols < n_cols
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK,)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK,)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(ACC)  # (BLOCK,)
    sig = tl.sigmoid(g)
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * g * sig
    tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, du.to(DU.dtype.element_ty), mask=mask)


def _block(n_cols: int) -> int:
    return min(next_pow2(n_cols), 4096)


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Launch the forward kernel: gate, up (..., f) -> y (..., f) in promote(gate, up) dtype."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    f = gate.shape[-1]
    g2, u2 = rows_2d(gate), rows_2d(up)  # (n, f)
    y2 = torch.empty(g2.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    block = _block(f)
    if g2.numel():
        _swiglu_fwd_kernel[(g2.shape[0], cdiv(f, block))](
            g2, u2, y2, g2.stride(0), u2.stride(0), y2.stride(0), f,
            ACC=acc_dtype(gate.dtype, up.dtype), BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return y2.view(gate.shape)


def swiglu_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the backward kernel -> (d gate, d up) in the dtypes of gate and up."""
    f = gate.shape[-1]
    dy2, g2, u2 = rows_2d(dy), rows_2d(gate), rows_2d(up)  # (n, f)
    dg2 = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)  # (n, f)
    du2 = torch.empty(u2.shape, dtype=up.dtype, device=up.device)  # (n, f)
    block = _block(f)
    if g2.numel():
        _swiglu_bwd_kernel[(g2.shape[0], cdiv(f, block))](
            dy2, g2, u2, dg2, du2, dy2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0),
            f, ACC=acc_dtype(gate.dtype, up.dtype), BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return dg2.view(gate.shape), du2.view(up.shape)


class SwiGLUFunction(torch.autograd.Function):
    """Differentiable w.r.t. gate and up; saves only the inputs."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return swiglu_forward(gate, up)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate, up = ctx.saved_tensors
        return swiglu_backward(dy, gate, up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Triton SwiGLU; same semantics as `swiglu_reference`."""
    return SwiGLUFunction.apply(gate, up)
