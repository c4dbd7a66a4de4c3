"""Rotary position embedding (rotate-half convention, as Hugging Face Llama), positions explicit.

Why positions are explicit: callers pass cos/sin for exactly the positions their tokens hold, so a
context-parallel rank whose shard is chunks r and 2*cp-1-r of the sequence gets the right rotation
without the kernel knowing about sharding. The Triton kernel rotates q and k in one launch (a few tokens
per program, all heads), reading cos/sin once per token; the backward is the same kernel with the
transposed rotation (see above `_rope_kernel`).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from parallel3d.kernels._triton_utils import acc_dtype, cdiv, next_pow2


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict] = None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in fp32, with optional Llama-3 frequency scaling.

    scaling: {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling:
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (s,) or (b, s) int -> cos, sin of shape positions.shape + (head_dim,) in fp32."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # (..., d/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (..., d)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s, hq, d), k (b, s, hk, d), cos/sin (s, d) or (b, s, d) -> rotated q, k (same dtypes)."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (b|1, s, 1, d)
    q_out = (q.float() * cos + _rotate_half(q.float()) * sin).to(q.dtype)
    k_out = (k.float() * cos + _rotate_half(k.float()) * sin).to(k.dtype)
    return q_out, k_out


@triton.jit
def _rotate_heads(X, Y, stride_h, stride_yh, n_heads, cos1, cos2, sin1, sin2, half,
                  BACKWARD: tl.constexpr, ACC: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    """Rotate all heads of one token. X, Y point at head 0, element 0 of that token."""
    heads = tl.arange(0, BLOCK_H)[:, None]  # (BLOCK_H, 1)
    dims = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D)
    mask = (heads < n_heads) & (dims < half)  # (BLOCK_H, BLOCK_D)
    x_ptr = X + heads * stride_h + dims
    x1 = tl.load(x_ptr, mask=mask, other=0.0).to(ACC)  # (BLOCK_H, BLOCK_D) first half
    x2 = tl.load(x_ptr + half, mask=mask, other=0.0).to(ACC)  # second half
    if BACKWARD:
        y1 = x1 * cos1 + x2 * sin2
        y2 = x2 * cos2 - x1 * sin1
    else:
        y1 = x1 * cos1 - x2 * sin1
        y2 = x2 * cos2 + x1 * sin2
    y_ptr = Y + heads * stride_yh + dims
    tl.store(y_ptr, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y_ptr + half, y2.to(Y.dtype.element_ty), mask=mask)


# Forward, per head with halves x = [x1, x2] and cos = [c1, c2], sin = [s1, s2]:
#   y1 = x1 c1 - x2 s1,   y2 = x2 c2 + x1 s2
# Backward is the transpose of that linear map (BACKWARD=True):
#   dx1 = dy1 c1 + dy2 s2,   dx2 = dy2 c2 - dy1 s1
# i.e. the forward with sin negated and its halves swapped (with the usual c1 = c2, s1 = s2 it is the
# rotation by -angle): the same kernel, the same bytes moved, only the signs differ. cos/sin get no gradient.
# Shapes: Q/QO (b, s, hq, d), K/KO (b, s, hk, d), COS/SIN (b, s, d) with batch stride 0 when shared.
@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, n_tokens, seq_len, n_q_heads, n_k_heads, half,
                 sqb, sqs, sqh, skb, sks, skh, sob, sos, soh, skob, skos, skoh, scb, scs,
                 BACKWARD: tl.constexpr, ACC: tl.constexpr, BLOCK_HQ: tl.constexpr,
                 BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr, TOKENS: tl.constexpr):
    """TOKENS consecutive tokens (b, s) per program; each token's cos/sin row is loaded once and rotates
    every q and k head. Several tokens per program: a quarter of the programs (16K -> 4K at b4 s4096), each
    with TOKENS independent loads in flight (the loop is unrolled)."""
    first = tl.program_id(0).to(tl.int64) * TOKENS
    dims = tl.arange(0, BLOCK_D)[None, :]  # (1, BLOCK_D)
    dmask = dims < half
    for i in tl.static_range(TOKENS):
        tok = first + i
        if tok < n_tokens:
            b = tok // seq_len
            s = tok % seq_len
            cs_off = b * scb + s * scs + dims
            cos1 = tl.load(COS + cs_off, mask=dmask, other=0.0).to(ACC)  # (1, BLOCK_D)
            cos2 = tl.load(COS + cs_off + half, mask=dmask, other=0.0).to(ACC)
            sin1 = tl.load(SIN + cs_off, mask=dmask, other=0.0).to(ACC)
            sin2 = tl.load(SIN + cs_off + half, mask=dmask, other=0.0).to(ACC)
            _rotate_heads(Q + b * sqb + s * sqs, QO + b * sob + s * sos, sqh, soh, n_q_heads,
                          cos1, cos2, sin1, sin2, half, BACKWARD, ACC, BLOCK_HQ, BLOCK_D)
            _rotate_heads(K + b * skb + s * sks, KO + b * skob + s * skos, skh, skoh, n_k_heads,
                          cos1, cos2, sin1, sin2, half, BACKWARD, ACC, BLOCK_HK, BLOCK_D)


def rope_tokens_per_program(n_tokens: int, heads: int, head_dim: int) -> int:
    """Tokens per program: 4 (each program then reads 4 * heads * head_dim elements, 40 KiB of bf16 q and k
    at Llama-3 8B's 32 + 8 heads of 128, and writes as much; launched with 8 warps, which keeps it at ~50
    registers), fewer for short inputs, 1 where one token is already >= 16K elements. A power of two (a
    constexpr: few compiled variants)."""
    if heads * head_dim >= 16384:
        return 1
    return 4 if n_tokens >= 4096 else (2 if n_tokens >= 64 else 1)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_apply(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               backward: bool = False, tokens_per_program: Optional[int] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the kernel: rotate q (b, s, hq, d) and k (b, s, hk, d) (or their gradients when
    backward=True). Inputs may be strided views (e.g. of a fused qkv projection); outputs are contiguous.
    tokens_per_program: None -> `rope_tokens_per_program` (tests force it to cover ragged tails)."""
    b, s, hq, d = q.shape
    hk = k.shape[2]
    if d % 2:
        raise ValueError(f"rope needs an even head dim, got {d}")
    q, k = _last_dim_contiguous(q), _last_dim_contiguous(k)
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos = _last_dim_contiguous(cos.expand(b, s, d))  # (b, s, d); batch stride 0 when shared
    sin = _last_dim_contiguous(sin.expand(b, s, d))
    if sin.stride() != cos.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    q_out, k_out = torch.empty_like(q, memory_format=torch.contiguous_format), \
        torch.empty_like(k, memory_format=torch.contiguous_format)
    if b * s == 0:
        return q_out, k_out
    half = d // 2
    tokens = tokens_per_program or rope_tokens_per_program(b * s, hq + hk, d)
    _rope_kernel[(cdiv(b * s, tokens),)](
        q, k, q_out, k_out, cos, sin, b * s, s, hq, hk, half,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), k_out.stride(0), k_out.stride(1), k_out.stride(2),
        cos.stride(0), cos.stride(1), BACKWARD=backward, ACC=acc_dtype(q.dtype, k.dtype, cos.dtype),
        BLOCK_HQ=next_pow2(hq), BLOCK_HK=next_pow2(hk), BLOCK_D=next_pow2(half), TOKENS=tokens,
        num_warps=4 if hq * d * tokens <= 8192 else 8)
    return q_out, k_out


class RoPEFunction(torch.autograd.Function):
    """Differentiable w.r.t. q and k (cos/sin are position buffers and get no gradient)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos, sin)
        return rope_apply(q, k, cos, sin)

    @staticmethod
    def backward(ctx, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor]):
        cos, sin = ctx.saved_tensors
        dq_in, dk_in = rope_apply(dq, dk, cos, sin, backward=True)
        return dq_in, dk_in, None, None


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton RoPE on q and k together; same semantics as `rope_reference`."""
    return RoPEFunction.apply(q, k, cos, sin)
