"""Grouped GEMM for Mixture-of-Experts: rows sorted by expert, one weight matrix per expert.

    forward    Y[rows_e]  = X[rows_e] @ W[e]^T        X (N, K), W (E, M, K) (nn.Linear layout) -> Y (N, M)
    backward   dX[rows_e] = dY[rows_e] @ W[e]         the same kernel, W read untransposed (strides)
               dW[e]      = dY[rows_e]^T @ X[rows_e]  a per-expert reduction over its rows (second kernel)

Why a kernel: the loop launches 2 GEMMs per expert and per projection (hundreds of small launches for
fine-grained MoE); here one launch covers every expert. The row tiles are planned on the host from the
per-expert counts (which the MoE dispatch has on the host anyway): tile t covers rows
[tile_start[t], tile_end[t]) of expert tile_expert[t], so no tile straddles two experts and an expert with
no rows costs nothing in the forward (its dW tile is written as zeros).

The torch twin `grouped_mm_reference` is the per-expert loop; `GroupedMM` is the autograd wrapper.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Sequence

import torch
import triton
import triton.language as tl

from parallel3d.kernels._triton_utils import acc_dtype, cdiv, dot_dtype, interpreting


def grouped_mm_reference(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """x (N, K) expert-major, weight (E, M, K), counts (E,) host ints -> (N, M)."""
    outs = [xe @ we.t() for xe, we in zip(x.split(list(counts)), weight.unbind(0))]  # (n_e, M)
    return torch.cat(outs) if outs else x.new_zeros(0, weight.shape[1])


@triton.jit
def _grouped_mm_kernel(A, B, C, TILE_EXPERT, TILE_START, TILE_END, n_out, k_dim, stride_am, stride_ak,
                       stride_be, stride_bk, stride_bn, stride_cm, stride_cn, DOT: tl.constexpr,
                       ACC: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """C[rows, :] = A[rows, :] @ B[e] for one row tile of one expert; B[e] is (k_dim, n_out) via strides."""
    tile = tl.program_id(0)
    e = tl.load(TILE_EXPERT + tile).to(tl.int64)
    row_end = tl.load(TILE_END + tile)
    rows = tl.load(TILE_START + tile) + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_mask, col_mask = rows < row_end, cols < n_out
    rows64 = rows.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), ACC)
    for k0 in range(0, k_dim, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
        k_mask = ks < k_dim
        a = tl.load(A + rows64[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(DOT)  # (BLOCK_M, BLOCK_K)
        b = tl.load(B + e * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0).to(DOT)  # (BLOCK_K, BLOCK_N)
        acc += tl.dot(a, b, input_precision=PREC, out_dtype=ACC)
    tl.store(C + rows64[:, None] * stride_cm + cols[None, :] * stride_cn, acc.to(C.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


# Weight gradient of Y = X W[e]^T on the rows of expert e: dW[e] = sum over its rows m of dY[m]^T X[m],
# i.e. (M, K) = dY[rows_e]^T (M, n_e) @ X[rows_e] (n_e, K). One program per (expert, M tile, K tile) walks
# the expert's rows in BLOCK_R steps; an expert without rows stores zeros.
@triton.jit
def _grouped_mm_wgrad_kernel(DY, X, DW, OFFSETS, m_dim, k_dim, stride_dym, stride_dyn, stride_xm, stride_xk,
                             stride_we, stride_wm, stride_wk, DOT: tl.constexpr, ACC: tl.constexpr,
                             PREC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    e = tl.program_id(0)
    outs = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,) rows of W[e]
    ks = tl.program_id(2) * BLOCK_K + tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    out_mask, k_mask = outs < m_dim, ks < k_dim
    start = tl.load(OFFSETS + e)
    end = tl.load(OFFSETS + e + 1)
    acc = tl.zeros((BLOCK_M, BLOCK_K), ACC)
    for r0 in range(start, end, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)  # (BLOCK_R,)
        row_mask = rows < end
        rows64 = rows.to(tl.int64)
        dy_t = tl.load(DY + rows64[None, :] * stride_dym + outs[:, None] * stride_dyn,
                       mask=out_mask[:, None] & row_mask[None, :], other=0.0).to(DOT)  # (BLOCK_M, BLOCK_R)
        x = tl.load(X + rows64[:, None] * stride_xm + ks[None, :] * stride_xk,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(DOT)  # (BLOCK_R, BLOCK_K)
        acc += tl.dot(dy_t, x, input_precision=PREC, out_dtype=ACC)
    tl.store(DW + e.to(tl.int64) * stride_we + outs[:, None] * stride_wm + ks[None, :] * stride_wk,
             acc.to(DW.dtype.element_ty), mask=out_mask[:, None] & k_mask[None, :])


def _blocks(dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M rows, BLOCK_N cols, BLOCK_K): 16-bit tiles sized for tensor cores without spills; fp32 keeps
    exact IEEE products (no tensor cores) in smaller tiles; the interpreter takes the smallest dot shape."""
    if interpreting():
        return 32, 32, 32  # fewer programs: the interpreter pays per program, not per element
    return (64, 128, 64) if dtype in (torch.bfloat16, torch.float16) else (32, 64, 32)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype in (torch.float32, torch.float64) else "tf32"


def upload_ints(rows: list, device: torch.device) -> torch.Tensor:
    """Host-planned int32 metadata on `device` without a host sync: a pageable host-to-device copy makes torch
    synchronise the stream, so CUDA gets a pinned, non-blocking copy (parallel3d.host_sync.upload's rule;
    kernels do not import the library)."""
    host = torch.tensor(rows, dtype=torch.int32)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device, non_blocking=True)


def tile_plan(counts: Sequence[int], block_m: int, device: torch.device) -> torch.Tensor:
    """(3, T) int32 on `device`: expert, first row, end row of each row tile (host arithmetic)."""
    experts, starts, ends, row = [], [], [], 0
    for e, n in enumerate(counts):
        for s in range(row, row + n, block_m):
            experts.append(e)
            starts.append(s)
            ends.append(row + n)
        row += n
    return upload_ints([experts, starts, ends], device)


def grouped_mm_forward(a: torch.Tensor, b: torch.Tensor, counts: Sequence[int], transpose_b: bool = True
                       ) -> torch.Tensor:
    """a (N, K) expert-major; b (E, M, K) with transpose_b (-> a_e @ b_e^T, (N, M)) or (E, K, M) without."""
    n, k_dim = a.shape
    n_out = b.shape[1] if transpose_b else b.shape[2]
    out = torch.empty((n, n_out), dtype=a.dtype, device=a.device)  # (N, M)
    block_m, block_n, block_k = _blocks(a.dtype)
    plan = tile_plan(counts, block_m, a.device)  # (3, T)
    if plan.shape[1] == 0 or n_out == 0:
        return out
    sbe, sb1, sb2 = b.stride()
    sbk, sbn = (sb2, sb1) if transpose_b else (sb1, sb2)
    _grouped_mm_kernel[(plan.shape[1], cdiv(n_out, block_n))](
        a, b, out, plan[0], plan[1], plan[2], n_out, k_dim, a.stride(0), a.stride(1), sbe, sbk, sbn,
        out.stride(0), out.stride(1), DOT=dot_dtype(a.dtype), ACC=acc_dtype(a.dtype), PREC=_precision(a.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=3)
    return out


def grouped_mm_weight_grad(dy: torch.Tensor, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """dW (E, M, K) = per expert dY[rows_e]^T @ X[rows_e]; dy (N, M), x (N, K)."""
    m_dim, k_dim = dy.shape[1], x.shape[1]
    dw = torch.empty((len(counts), m_dim, k_dim), dtype=x.dtype, device=x.device)  # (E, M, K)
    if len(counts) == 0 or m_dim == 0 or k_dim == 0:
        return dw
    offsets = upload_ints([0, *accumulate(counts)], x.device)  # (E+1,) first row of each expert
    block_r, block_m, block_k = _blocks(x.dtype)
    block_m = min(block_m, 64)  # (BLOCK_M, BLOCK_K) accumulator: keep it in registers
    _grouped_mm_wgrad_kernel[(len(counts), cdiv(m_dim, block_m), cdiv(k_dim, block_k))](
        dy, x, dw, offsets, m_dim, k_dim, dy.stride(0), dy.stride(1), x.stride(0), x.stride(1), dw.stride(0),
        dw.stride(1), dw.stride(2), DOT=dot_dtype(x.dtype), ACC=acc_dtype(x.dtype), PREC=_precision(x.dtype),
        BLOCK_R=block_r, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4, num_stages=3)
    return dw


class GroupedMM(torch.autograd.Function):
    """y = x_e @ W[e]^T per expert group; differentiable w.r.t. x and W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        return grouped_mm_forward(x, weight, counts)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        dx = grouped_mm_forward(dy, weight, ctx.counts, transpose_b=False) if ctx.needs_input_grad[0] else None
        dw = grouped_mm_weight_grad(dy, x, ctx.counts) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
    """Triton grouped GEMM: x (N, K) rows sorted by expert, weight (E, M, K), counts (E,) -> (N, M)."""
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2] or len(counts) != weight.shape[0]:
        raise ValueError(f"grouped_mm: x {tuple(x.shape)}, weight {tuple(weight.shape)}, {len(counts)} counts")
    if sum(counts) != x.shape[0]:
        raise ValueError(f"grouped_mm: counts sum to {sum(counts)} but x has {x.shape[0]} rows")
    return GroupedMM.apply(x, weight, tuple(int(c) for c in counts))
