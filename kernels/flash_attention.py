"""Scaled dot-product attention returning the log-sum-exp (so ring attention can merge blocks).

Why our own kernel: ring attention needs, per block, the output *and* its lse (b, hq, sq) in fp32 and a
backward that takes the merged (global) out/lse. SDPA returns no lse. The Triton kernels are
FlashAttention-2 style: the forward here streams key blocks with an online softmax; the backward
(flash_attention_bwd.py) recomputes the probabilities from lse. This file holds the forward, the torch
twins (`attention_reference`, `sdpa_attention`) and the autograd wrapper. Inside the kernels the softmax is in
base 2 (`exp2`, log2(e) folded into the logit scale; the lse at the interface stays natural), every loop
runs its whole blocks unmasked and only the causal-diagonal / ragged blocks masked, and the launch tiles
come from one table per kernel, arch and head dim (_flash_common.py).

Conventions as `attention_reference`: q (b, sq, hq, d), k/v (b, sk, hk, d), hq % hk == 0; causal is
bottom-right aligned (query i sees keys j <= i + sk - sq); rows seeing no key give out 0, lse -inf.
lse is differentiable too (d lse_i / d s_ij = p_ij), so a merge done with autograd gets exact gradients.

Packed documents (varlen): q_doc (b, sq) / k_doc (b, sk) int32 document ids make a query see only keys of
its own document (HAS_DOC). Each tile's [min, max] id range is compared with the other side's, and a key
tile (forward, dQ) or query tile (dK/dV) whose range misses it is skipped without loading K/V or Q; the
per-pair equality test inside a visited tile is what is exact (ids are nondecreasing along the sequence in
every caller, which makes the range test tight).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from parallel3d.kernels._flash_common import (_check, _doc_block, _docs, _exp, _heavy_first, _kernel_dtypes,
                                              _key_range, _lse_from_base, _pair_mask, _prep, launch_config,
                                              logit_scale, tile_operand, use_tma)
from parallel3d.kernels._triton_utils import cdiv, next_pow2
from parallel3d.kernels.flash_attention_bwd import flash_attention_backward

__all__ = ["attention_reference", "sdpa_attention", "flash_attention", "flash_attention_forward",
           "flash_attention_backward", "FlashAttentionFunction"]


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        scale: Optional[float] = None, q_doc: Optional[torch.Tensor] = None,
                        k_doc: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, sq, hq, d), k/v (b, sk, hk, d) with hq % hk == 0 (GQA) -> out (b, sq, hq, d), lse (b, hq, sq) fp32
    (fp64 for fp64 inputs, which are computed exactly).

    Causal masking is bottom-right aligned: query i sees keys j <= i + (sk - sq).
    Rows that see no key get out = 0 and lse = -inf. q_doc (b, sq) / k_doc (b, sk): document ids; a query
    then also sees only keys of its own document (dense: a test and short-block reference).
    """
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    rep = hq // hk
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32  # fp64 stays exact (CP tests)
    kf = k.to(acc).repeat_interleave(rep, dim=2)  # (b, sk, hq, d)
    vf = v.to(acc).repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.to(acc), kf) * scale  # (b, hq, sq, sk)
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (sk - sq), float("-inf"))
    if q_doc is not None:
        k_doc = q_doc if k_doc is None else k_doc
        other_doc = q_doc[:, None, :, None] != k_doc[:, None, None, :]  # (b, 1, sq, sk)
        scores = scores.masked_fill(other_doc, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (b, hq, sq)
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(acc).min))
    probs = torch.nan_to_num(probs, nan=0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vf)  # (b, sq, hq, d)
    return out.to(q.dtype), lse


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                   scale: Optional[float] = None) -> torch.Tensor:
    """The fast path without lse: torch SDPA. Shapes as attention_reference; requires sq == sk if causal."""
    hq, hk = q.shape[2], k.shape[2]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=scale,
        enable_gqa=hq != hk)  # (b, hq, s, d)
    return out.transpose(1, 2)


@triton.jit
def _fwd_step(acc, l_i, m_i, q, k_base, v_base, KDOC, start_n, offs_n, rows, dims, dmask, qd, q_lo, q_hi, sks, svs,
              seq_q, seq_k, diag, qk_scale, b, hk, MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr,
              DOT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, EXP2: tl.constexpr, TMA: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One key block of the online softmax (logits in the kernel's base, `_exp`). MASKED: the block may hold
    keys past seq_k or, causal, above some row's diagonal, so those pairs are masked; the others need none.
    HAS_DOC: a block whose id range misses the query block's is skipped, and pairs of two documents masked.
    TMA: k_base / v_base are tensor descriptors of the whole K / V, boxes at (b, start_n, hk, 0). The logit
    scale (> 0) is applied after the row max and inside the exponent's subtraction, one FMA per logit."""
    cols = start_n + offs_n  # (BLOCK_N,)
    kd = tl.full(offs_n.shape, 0, tl.int32)
    visit = True
    if HAS_DOC:
        kd, k_lo, k_hi = _doc_block(KDOC, cols, seq_k)
        visit = (k_hi >= q_lo) & (k_lo <= q_hi)  # the id ranges meet: some pair may share a document
    if visit:
        if TMA:
            k_t = tl.trans(k_base.load([b, start_n, hk, 0]).reshape(BLOCK_N, BLOCK_D).to(DOT))  # (BLOCK_D, BLOCK_N)
        else:
            k_t = tl.load(k_base + cols[None, :] * sks + dims[:, None],
                          mask=dmask[:, None] & (cols[None, :] < seq_k), other=0.0).to(DOT)  # (BLOCK_D, BLOCK_N)
        s = tl.dot(q, k_t, input_precision=PREC, out_dtype=ACC)  # (BLOCK_M, BLOCK_N), unscaled
        if MASKED or HAS_DOC:
            valid = _pair_mask(rows[:, None], cols[None, :], qd[:, None], kd[None, :], seq_q, seq_k, diag, MASKED,
                               CAUSAL, HAS_DOC)  # (BLOCK_M, BLOCK_N)
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # row fully masked so far
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
            m_safe = m_new  # no mask: every row has a finite logit
        p = _exp(s * qk_scale - m_safe[:, None], EXP2)  # (BLOCK_M, BLOCK_N)
        alpha = _exp(m_i - m_safe, EXP2)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if TMA:
            v = v_base.load([b, start_n, hk, 0]).reshape(BLOCK_N, BLOCK_D).to(DOT)  # (BLOCK_N, BLOCK_D)
        else:
            v = tl.load(v_base + cols[:, None] * svs + dims[None, :],
                        mask=(cols[:, None] < seq_k) & dmask[None, :], other=0.0).to(DOT)  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PREC, out_dtype=ACC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, QDOC, KDOC, qk_scale, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos,
                     soh, n_q_heads, group, seq_q, seq_k, head_dim, CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr,
                     DOT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, EXP2: tl.constexpr,
                     TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (q blocks, b * hq): online softmax over key blocks; out = acc / l, lse = m + log(l) (natural log).
    The key loop runs in two parts (`_key_range`): the blocks every row of the query block sees whole
    (below the causal diagonal, inside seq_k) without masks, then the rest (the diagonal, the ragged last
    block) masked. Causal without documents: query blocks run last first (`_heavy_first`). HAS_DOC: QDOC
    (b, sq) / KDOC (b, sk) int32 document ids; a query sees only keys of its own document, and a key block
    whose id range misses the query block's is skipped. TMA: Q, K, V are tensor descriptors
    (`_flash_common.tile_operand`)."""
    pid_m = _heavy_first(tl.program_id(0), tl.num_programs(0), CAUSAL and not HAS_DOC)
    bh = tl.program_id(1)
    b32 = bh // n_q_heads  # TMA coordinates are 32-bit; pointer offsets 64-bit
    b = b32.to(tl.int64)
    h = bh % n_q_heads
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    if TMA:
        q = Q.load([b32, pid_m * BLOCK_M, h, 0]).reshape(BLOCK_M, BLOCK_D).to(DOT)  # (BLOCK_M, BLOCK_D)
        k_base = K
        v_base = V
    else:
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :],
                    mask=(rows[:, None] < seq_q) & dmask[None, :], other=0.0).to(DOT)  # (BLOCK_M, BLOCK_D)
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh
    kdoc = KDOC + b * seq_k
    diag = seq_k - seq_q
    m_i = tl.full((BLOCK_M,), float("-inf"), ACC)
    l_i = tl.zeros((BLOCK_M,), ACC)
    acc = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    qd = tl.full((BLOCK_M,), 0, tl.int32)
    q_lo, q_hi = 0, 0
    if HAS_DOC:
        qd, q_lo, q_hi = _doc_block(QDOC + b * seq_q, rows, seq_q)
    whole, hi = _key_range(pid_m, seq_q, seq_k, CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, whole, BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_base, v_base, kdoc, start_n, offs_n, rows, dims, dmask, qd,
                                  q_lo, q_hi, sks, svs, seq_q, seq_k, diag, qk_scale, b32, hk, False, CAUSAL, HAS_DOC,
                                  DOT, ACC, PREC, EXP2, TMA, BLOCK_N, BLOCK_D)
    for start_n in range(whole, hi, BLOCK_N):
        acc, l_i, m_i = _fwd_step(acc, l_i, m_i, q, k_base, v_base, kdoc, start_n, offs_n, rows, dims, dmask, qd,
                                  q_lo, q_hi, sks, svs, seq_q, seq_k, diag, qk_scale, b32, hk, True, CAUSAL, HAS_DOC,
                                  DOT, ACC, PREC, EXP2, TMA, BLOCK_N, BLOCK_D)
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]  # (BLOCK_M, BLOCK_D)
    lse = tl.where(empty, float("-inf"), _lse_from_base(m_i, tl.where(empty, 1.0, l_i), EXP2))  # (BLOCK_M,)
    tl.store(O + b * sob + h * soh + rows[:, None] * sos + dims[None, :], out.to(O.dtype.element_ty),
             mask=(rows[:, None] < seq_q) & dmask[None, :])
    tl.store(LSE + bh.to(tl.int64) * seq_q + rows, lse, mask=rows < seq_q)


# Backward preprocessing: delta_i = sum_d dO_id * O_id - dlse_i. It is the row term of the softmax
# Jacobian: dS_ij = P_ij * (dP_ij - delta_i) where dP = dO V^T; the dlse term comes from
# d lse_i / d S_ij = P_ij. O, DO share the contiguous (b, sq, hq, d) layout; DELTA is (b, hq, sq).
def flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                            scale: Optional[float] = None, block_m: Optional[int] = None,
                            block_n: Optional[int] = None, q_doc: Optional[torch.Tensor] = None,
                            k_doc: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel -> (out (b, sq, hq, d) in q.dtype, lse (b, hq, sq) fp32 (fp64 for fp64)).
    q_doc (b, sq) / k_doc (b, sk): document ids (varlen / packed documents), see `_docs`."""
    _check(q, k, v)
    q, k, v = _prep(q), _prep(k), _prep(v)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = torch.empty((b, sq, hq, d), dtype=q.dtype, device=q.device)  # (b, sq, hq, d)
    lse = torch.full((b, hq, sq), float("-inf"), dtype=torch.float64 if q.dtype == torch.float64
                     else torch.float32, device=q.device)  # (b, hq, sq)
    if b * sq * hq == 0:
        return out, lse
    bm, bn, warps, stages = launch_config("fwd", d, q.dtype, q.device, block_m, block_n)
    bd = next_pow2(max(d, 16))
    tma = use_tma("fwd", d, q.device, q, k, v)
    qd, kd = _docs(q_doc, k_doc, q)
    _attn_fwd_kernel[(cdiv(sq, bm), b * hq)](
        tile_operand(q, bm, bd, tma), tile_operand(k, bn, bd, tma), tile_operand(v, bn, bd, tma), out, lse, qd, kd,
        logit_scale(scale, q), *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        hq, hq // hk, sq, sk, d, CAUSAL=causal, HAS_DOC=q_doc is not None, **_kernel_dtypes(q), TMA=tma, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, num_stages=stages)
    return out, lse


def _score_pairs(q_shape, k_shape, causal: bool) -> float:
    """(query, key) pairs the kernel computes per (batch, head): causal is bottom-right aligned and the
    kernel skips fully masked tiles, so it does about the visible half of the square."""
    sq, sk = q_shape[1], k_shape[1]
    return sq * (sk - sq) + sq * (sq + 1) / 2 if causal and sk >= sq else sq * sk


def attention_fwd_flops(q_shape, k_shape, v_shape, causal, *args, **kwargs) -> int:
    """Two matmuls (q k^T, p v): 2 * 2 * b * hq * pairs * d (FlopCounterMode and the planner read it, through
    the custom ops in kernels/ops.py and attention_standin's op)."""
    b, _, hq, d = q_shape
    return int(4 * b * hq * _score_pairs(q_shape, k_shape, causal) * d)


def attention_bwd_flops(do_shape, q_shape, k_shape, v_shape, o_shape, lse_shape, causal, *args, **kwargs) -> int:
    """Five matmuls (recomputed q k^T, dv, dp, dq, dk): 2.5 times the forward."""
    b, _, hq, d = q_shape
    return int(10 * b * hq * _score_pairs(q_shape, k_shape, causal) * d)


class FlashAttentionFunction(torch.autograd.Function):
    """(out, lse); differentiable w.r.t. q, k, v through both outputs."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: Optional[float], block_m: Optional[int], block_n: Optional[int],
                q_doc: Optional[torch.Tensor], k_doc: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = flash_attention_forward(q, k, v, causal, scale, block_m, block_n, q_doc, k_doc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, block_m, block_n)
        ctx.docs = (q_doc, k_doc)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Optional[torch.Tensor], dlse: Optional[torch.Tensor]):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, block_m, block_n = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = flash_attention_backward(dout, q, k, v, out, lse, causal, scale, dlse, block_m, block_n,
                                              *ctx.docs)
        return dq, dk, dv, None, None, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    scale: Optional[float] = None, block_m: Optional[int] = None,
                    block_n: Optional[int] = None, q_doc: Optional[torch.Tensor] = None,
                    k_doc: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton flash attention -> (out (b, sq, hq, d), lse (b, hq, sq) fp32); as `attention_reference`
    (document ids q_doc (b, sq), k_doc (b, sk) included: varlen attention over packed documents)."""
    return FlashAttentionFunction.apply(q, k, v, causal, scale, block_m, block_n, q_doc, k_doc)
