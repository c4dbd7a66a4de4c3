"""FP8 casts with their scales (train.fp8): amax, scale and saturating cast fused per tensor or per row.

    amax = max |t|  (whole tensor, or along `axis`: 1 one per row, 0 one per column)
    s    = (1 / max(amax, 1e-12)) * fp8_max        t8 = saturate(t * s) in e4m3fn / e5m2     inv = 1 / s

Why fused: the unfused cast reads t for |t|, its amax, then t again for t * s, writes the fp32 product,
reads it for the clamp and again for the conversion: five passes over a tensor per operand per GEMM.
  tensorwise  two passes: one amax pass (program partial maxima, reduced to one scalar), then one fused
              scale + cast + saturate pass. Tensor parallelism may MAX all-reduce the scalar between them.
  axiswise    one pass per row (or column): amax, scale and cast in one program, t read once when the row
              fits in a tile (else twice, the second time from L2). Where TP splits the reduced dimension
              the amax is needed first (amax pass, all-reduce, then a cast pass with the given amax).
The pure-torch twin (`cast_reference`) is what tensor_parallel/fp8.py ran before; the kernels reproduce
its bytes exactly: the same fp32 formula (torch's `fmax / t` is `t.reciprocal() * fmax`, so the kernels
take the correctly rounded reciprocal, `div_rn`, then multiply), and round-to-nearest-even conversion.
The Triton interpreter's fp32 -> fp8 conversion drops the carry of a round-up into the next binade
(127.95 -> 64 instead of 128 in e4m3fn), so under TRITON_INTERPRET the conversion is done here with
integer arithmetic (`_fp8_bits`, exact RNE); compiled kernels use the hardware's cvt (also RNE, sm_89+).
No autograd Function: the casts run inside fp8.Fp8Linear's forward and backward and are not
differentiated. Their custom ops (meta / fake implementations, for the planner's dry run) and the entry
points that choose between an op and its body (`cast`, `cast_given_amax`) are in kernels/fp8_cast_ops.py,
as kernels/ops.py holds the other kernels'.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from parallel3d.kernels._triton_utils import cdiv, interpreting, next_pow2, num_programs_hint

_FP8 = {torch.float8_e4m3fn: (tl.float8e4nv, 3, 7), torch.float8_e5m2: (tl.float8e5, 2, 15)}  # (tl, mant, bias)
TILE = 8192  # elements per program tile


# ---- the twin -----------------------------------------------------------------------------------------
def amax_reference(t: Tensor, axis: Optional[int]) -> Tensor:
    """fp32 amax of |t|: whole tensor (axis None, shape ()) or along `axis` (kept: (n, 1) / (1, k))."""
    a = t.abs().amax() if axis is None else t.abs().amax(axis, keepdim=True)
    return a.float()


def scale_cast_reference(t: Tensor, amax: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(t8 in `dtype`, inverse scale fp32 shaped like amax): t8 = saturate(t * fp8_max / amax)."""
    fmax = torch.finfo(dtype).max
    scale = fmax / amax.clamp_min(1e-12)  # torch: amax.reciprocal() * fmax
    t8 = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return t8, scale.reciprocal()


def cast_reference(t: Tensor, dtype: torch.dtype, axis: Optional[int] = None, reduce_amax=None,
                   col_major: bool = False) -> tuple[Tensor, Tensor]:
    """The whole cast; `reduce_amax` (e.g. a TP MAX all-reduce) is applied to the amax before scaling.
    col_major: t8 (n, k) stored transposed (strides (1, n)), as a GEMM takes its second operand."""
    amax = amax_reference(t, axis)
    t8, inv = scale_cast_reference(t, amax if reduce_amax is None else reduce_amax(amax), dtype)
    return (_col_major(t8) if col_major else t8), inv


def _col_major(t: Tensor) -> Tensor:
    return t.t().contiguous().t()


def _out(t: Tensor, dtype: torch.dtype, col_major: bool) -> Tensor:
    """The (n, k) fp8 output: row-major, or column-major (strides (1, n))."""
    n, k = t.shape
    return torch.empty_strided((n, k), (1, n) if col_major else (k, 1), dtype=dtype, device=t.device)


# ---- kernels ------------------------------------------------------------------------------------------
@triton.jit
def _fp8_bits(v, OUT: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MANUAL: tl.constexpr):
    """fp32 v (already within +-fp8_max) -> the fp8 byte (uint8), round to nearest even."""
    if MANUAL:
        bits = v.to(tl.uint32, bitcast=True)
        sign = (bits >> 31) << 7
        mag = bits & 0x7FFFFFFF
        exp = (mag >> 23).to(tl.int32) - 127
        # normal target: keep MANT mantissa bits; the carry of the rounding runs into the exponent
        low: tl.constexpr = 23 - MANT
        normal = (mag + ((1 << (low - 1)) - 1) + ((mag >> low) & 1)) >> low
        normal = normal - ((127 - BIAS) << MANT)
        # subnormal target (exp < 1 - BIAS): the integer count of the smallest step 2^(1 - BIAS - MANT)
        sh = tl.minimum((24 - BIAS - MANT) - exp, 31).to(tl.uint32)
        m = (mag & 0x7FFFFF) | 0x800000
        sub = (m + ((1 << (sh - 1)) - 1) + ((m >> sh) & 1)) >> sh
        code = tl.where(exp < 1 - BIAS, sub, normal)
        code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN
        return (code | sign).to(tl.uint8)
    return v.to(OUT).to(tl.uint8, bitcast=True)


@triton.jit
def _scale_of(amax, FMAX: tl.constexpr):
    """s = (1 / max(amax, 1e-12)) * fp8_max, as the twin's torch ops round it."""
    return tl.math.div_rn(1.0, tl.maximum(amax, 1e-12)) * FMAX


@triton.jit
def _amax_partial_kernel(X, P, n_rows, n_cols, sx_r, sx_c, BR: tl.constexpr, BC: tl.constexpr):
    """One program per (BR, BC) tile: its max |x| into P[program]."""
    pr, pc = tl.program_id(0), tl.program_id(1)
    rows = pr * BR + tl.arange(0, BR)  # (BR,)
    cols = pc * BC + tl.arange(0, BC)  # (BC,)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    ptr = X + rows[:, None].to(tl.int64) * sx_r + cols[None, :].to(tl.int64) * sx_c
    x = tl.abs(tl.load(ptr, mask=mask, other=0.0).to(tl.float32))  # (BR, BC)
    tl.store(P + pr * tl.num_programs(1) + pc, tl.max(tl.max(x, axis=1), axis=0))


@triton.jit
def _scale_cast_kernel(X, AMAX, Y, INV, n_rows, n_cols, sx_r, sx_c, sy_r, sy_c, FMAX: tl.constexpr,
                       OUT: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr, MANUAL: tl.constexpr,
                       BR: tl.constexpr, BC: tl.constexpr):
    """Tensorwise: one scalar amax; y = saturate(x * s) as fp8 bytes; the first program writes 1 / s."""
    pr, pc = tl.program_id(0), tl.program_id(1)
    s = _scale_of(tl.load(AMAX), FMAX)
    rows = pr * BR + tl.arange(0, BR)  # (BR,)
    cols = pc * BC + tl.arange(0, BC)  # (BC,)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    r64, c64 = rows[:, None].to(tl.int64), cols[None, :].to(tl.int64)
    x = tl.load(X + r64 * sx_r + c64 * sx_c, mask=mask, other=0.0).to(tl.float32)  # (BR, BC)
    y = tl.clamp(x * s, -FMAX, FMAX)
    tl.store(Y + r64 * sy_r + c64 * sy_c, _fp8_bits(y, OUT, MANT, BIAS, MANUAL), mask=mask)
    if (pr == 0) & (pc == 0):
        tl.store(INV, tl.math.div_rn(1.0, s))


@triton.jit
def _cast_store(x, s, Y, m, FMAX: tl.constexpr, OUT: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                MANUAL: tl.constexpr):
    """Store saturate(x * s) (x (BL, BR) fp32, s (BL,)) as fp8 bytes at the pointers Y where m."""
    y = tl.clamp(x * s[:, None], -FMAX, FMAX)  # (BL, BR)
    tl.store(Y, _fp8_bits(y, OUT, MANT, BIAS, MANUAL), mask=m)


@triton.jit
def _axis_kernel(X, AMAX, Y, INV, n_lanes, n_red, red_per_prog, sx_l, sx_r, sy_l, sy_r, MODE: tl.constexpr,
                 FMAX: tl.constexpr, OUT: tl.constexpr, MANT: tl.constexpr, BIAS: tl.constexpr,
                 MANUAL: tl.constexpr, BL: tl.constexpr, BR: tl.constexpr, ONE_TILE: tl.constexpr):
    """Axiswise: each lane (a row for row scales, a column for column scales) reduced along `red`; program
    (i, j) takes lanes [i BL, (i + 1) BL) and `red_per_prog` of the reduced dimension from j red_per_prog.
    MODE 0: amax only (partial maxima into AMAX[j, lane]); 1: amax, scale and cast in one pass (one program
    along red); 2: cast with the given AMAX (lane,). ONE_TILE (one program along red, which fits in BR): x is
    read once; else the amax loop, then the cast loop."""
    pid_r = tl.program_id(1)
    lanes = tl.program_id(0) * BL + tl.arange(0, BL)  # (BL,)
    lmask = lanes < n_lanes
    xl = X + lanes[:, None].to(tl.int64) * sx_l  # (BL, 1) lane bases
    yl = Y + lanes[:, None].to(tl.int64) * sy_l
    red = tl.arange(0, BR)  # (BR,)
    if ONE_TILE:
        m = lmask[:, None] & (red[None, :] < n_red)
        x = tl.load(xl + red[None, :].to(tl.int64) * sx_r, mask=m, other=0.0).to(tl.float32)  # (BL, BR)
        if MODE == 2:
            amax = tl.load(AMAX + lanes, mask=lmask, other=1.0)  # (BL,)
        else:
            amax = tl.max(tl.abs(x), axis=1)  # (BL,)
        if MODE == 0:
            tl.store(AMAX + lanes, amax, mask=lmask)
        else:
            s = _scale_of(amax, FMAX)  # (BL,)
            tl.store(INV + lanes, tl.math.div_rn(1.0, s), mask=lmask)
            _cast_store(x, s, yl + red[None, :].to(tl.int64) * sy_r, m, FMAX, OUT, MANT, BIAS, MANUAL)
    else:
        r_start = pid_r * red_per_prog
        r_end = tl.minimum(r_start + red_per_prog, n_red)
        if MODE == 2:
            amax = tl.load(AMAX + lanes, mask=lmask, other=1.0)  # (BL,)
        else:
            acc = tl.zeros((BL, BR), dtype=tl.float32)
            for r0 in range(r_start, r_end, BR):
                m = lmask[:, None] & (r0 + red[None, :] < r_end)
                x = tl.load(xl + (r0 + red[None, :]).to(tl.int64) * sx_r, mask=m, other=0.0).to(tl.float32)
                acc = tl.maximum(acc, tl.abs(x))  # (BL, BR)
            amax = tl.max(acc, axis=1)  # (BL,)
        if MODE == 0:
            tl.store(AMAX + pid_r.to(tl.int64) * n_lanes + lanes, amax, mask=lmask)
        else:
            s = _scale_of(amax, FMAX)  # (BL,)
            if pid_r == 0:
                tl.store(INV + lanes, tl.math.div_rn(1.0, s), mask=lmask)
            for r0 in range(r_start, r_end, BR):
                m = lmask[:, None] & (r0 + red[None, :] < r_end)
                x = tl.load(xl + (r0 + red[None, :]).to(tl.int64) * sx_r, mask=m, other=0.0).to(tl.float32)
                _cast_store(x, s, yl + (r0 + red[None, :]).to(tl.int64) * sy_r, m, FMAX, OUT, MANT, BIAS, MANUAL)


# ---- launch functions (2-D tensors, any strides) ------------------------------------------------------
def _tile(n_rows: int, n_cols: int, col_major: bool = False) -> tuple[int, int]:
    """(rows, cols) of a program's tile: wide rows; 128 rows when the output is stored column-major (runs of
    128 bytes there too, the compiler converting the layout between the load and the store)."""
    if col_major:
        br = min(next_pow2(n_rows), 128)
        return br, min(next_pow2(n_cols), max(TILE // br, 1))
    bc = min(next_pow2(n_cols), 1024)
    return min(next_pow2(n_rows), max(TILE // bc, 1)), bc


def _consts(dtype: torch.dtype) -> dict:
    if dtype not in _FP8:
        raise TypeError(f"fp8 casts write float8_e4m3fn or float8_e5m2, not {dtype}")
    out, mant, bias = _FP8[dtype]
    return dict(FMAX=float(torch.finfo(dtype).max), OUT=out, MANT=mant, BIAS=bias, MANUAL=interpreting())


def amax_tensor(t: Tensor) -> Tensor:
    """max |t| of a 2-D tensor as an fp32 scalar: tile partial maxima, then their max."""
    n, k = t.shape
    br, bc = _tile(n, k)
    grid = (cdiv(n, br), cdiv(k, bc))
    part = torch.zeros(grid[0] * grid[1], dtype=torch.float32, device=t.device)  # (programs,)
    if t.numel():
        _amax_partial_kernel[grid](t, part, n, k, t.stride(0), t.stride(1), BR=br, BC=bc, num_warps=4)
    return part.amax()


def scale_cast(t: Tensor, amax: Tensor, dtype: torch.dtype, col_major: bool = False) -> tuple[Tensor, Tensor]:
    """Tensorwise fused scale + cast + saturate of a 2-D t with a scalar fp32 amax -> (t8, inv ())."""
    n, k = t.shape
    y = _out(t, dtype, col_major)  # (n, k)
    inv = torch.empty((), dtype=torch.float32, device=t.device)
    br, bc = _tile(n, k, col_major)
    if t.numel():
        _scale_cast_kernel[(cdiv(n, br), cdiv(k, bc))](
            t, amax.reshape(()).float(), y.view(torch.uint8), inv, n, k, t.stride(0), t.stride(1), y.stride(0),
            y.stride(1), BR=br, BC=bc, num_warps=8, **_consts(dtype))  # 4 warps kept 8 B of stack (fp16, sm_90)
    else:
        inv = scale_cast_reference(t, amax, dtype)[1]
    return y, inv


def _axis_launch(t: Tensor, axis: int, mode: int, dtype: Optional[torch.dtype], amax: Optional[Tensor],
                 max_block: int, col_major: bool = False) -> tuple[Optional[Tensor], Tensor]:
    """MODE 0 / 1 / 2 of _axis_kernel over a 2-D t. Too few lane blocks to fill the device (columns of a
    (tokens, 4096) tensor: 64 programs) split the reduced dimension over programs as well; a fused cast is
    then an amax launch (partial maxima, reduced here), then a cast launch with that amax."""
    n, k = t.shape
    if t.numel() == 0:  # (the twin's answer, or its error for an empty reduction)
        if mode == 0:
            return None, amax_reference(t, axis)
        t8, inv = scale_cast_reference(t, amax_reference(t, axis) if mode == 1 else amax, dtype)
        return (_col_major(t8) if col_major else t8), inv
    lanes, red = (n, k) if axis == 1 else (k, n)
    sx_l, sx_r = (t.stride(0), t.stride(1)) if axis == 1 else (t.stride(1), t.stride(0))
    sy = (1, n) if col_major else (k, 1)  # the output's strides
    sy_l, sy_r = sy if axis == 1 else sy[::-1]
    shape = (n, 1) if axis == 1 else (1, k)
    if axis == 1:   # rows: the reduced dimension is contiguous, a few rows per program
        br = min(next_pow2(red), max_block)
        bl = min(next_pow2(lanes), max(2048 // br, 1))
    else:           # columns: lanes contiguous, rows looped
        bl = min(next_pow2(lanes), 64)
        br = min(next_pow2(red), max(max_block // bl, 1))
    lane_progs, want = cdiv(lanes, bl), num_programs_hint(t.device)
    split = min(cdiv(red, br), cdiv(want, lane_progs)) if lane_progs < want else 1
    per_prog = cdiv(cdiv(red, split), br) * br  # (a multiple of BR)
    split = cdiv(red, per_prog)
    if mode == 1 and split > 1:
        mode, amax = 2, _axis_launch(t, axis, 0, None, None, max_block)[1]
    y = _out(t, dtype, col_major) if mode else None  # (n, k)
    stat = (amax.float().contiguous() if mode == 2 else
            torch.empty((split, lanes), dtype=torch.float32, device=t.device))  # (lanes,) / (split, lanes)
    inv = torch.empty(shape, dtype=torch.float32, device=t.device)
    _axis_kernel[(lane_progs, split)](
        t, stat, y.view(torch.uint8) if mode else t, inv, lanes, red, per_prog, sx_l, sx_r, sy_l, sy_r, MODE=mode,
        BL=bl, BR=br, ONE_TILE=split == 1 and red <= br, num_warps=min(max(bl * br // 512, 1), 16),
        **_consts(torch.float8_e4m3fn if dtype is None else dtype))
    return (y, inv) if mode else (None, stat.amax(0).view(shape))


def amax_axis(t: Tensor, axis: int, max_block: int = TILE) -> Tensor:
    """fp32 amax of a 2-D t along `axis`, kept: (n, 1) for axis 1, (1, k) for axis 0."""
    return _axis_launch(t, axis, 0, None, None, max_block)[1]


def cast_axis(t: Tensor, axis: int, dtype: torch.dtype, amax: Optional[Tensor] = None, max_block: int = TILE,
              col_major: bool = False) -> tuple[Tensor, Tensor]:
    """Axiswise (t8, inv shaped like the amax): one fused pass, or with a given (reduced) `amax`."""
    return _axis_launch(t, axis, 1 if amax is None else 2, dtype, amax, max_block, col_major)
