"""The flash-attention backward's dQ pass: one program per query block and q head, streaming the key blocks
it sees (the forward's loop, split the same way). flash_attention_bwd.py holds the delta pre-pass, dK/dV and
the launcher, which runs this after dK/dV; conventions and document masking as kernels/flash_attention.py.
"""
from __future__ import annotations

import triton
import triton.language as tl

from parallel3d.kernels._flash_common import (_doc_block, _exp, _heavy_first, _key_range, _lse_to_base,
                                              _pair_mask)


# dQ for one q block of one q head: dQ = scale * sum_j dS_ij K_j over the visible key blocks, with
# dS = P * (dO V^T - delta) as above. DQ shares the contiguous layout of DO.
@triton.jit
def _dq_step(dq, q, do, lse, delta, k_base, v_base, KDOC, start_n, offs_n, rows, dims, dmask, qd, q_lo, q_hi, sks,
             svs, seq_q, seq_k, diag, qk_scale, b, hk, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
             HAS_DOC: tl.constexpr, DOT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, EXP2: tl.constexpr,
             TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """One key block's share of dQ; MASKED as in the forward (keys past seq_k load K = V = 0, so unmasked
    steps inside seq_k need no bounds masks either). TMA: k_base / v_base are descriptors, as the forward's."""
    cols = start_n + offs_n  # (BLOCK_N,)
    kd = tl.full(offs_n.shape, 0, tl.int32)
    visit = True
    if HAS_DOC:
        kd, k_lo, k_hi = _doc_block(KDOC, cols, seq_k)
        visit = (k_hi >= q_lo) & (k_lo <= q_hi)
    if visit:
        if TMA:
            k = k_base.load([b, start_n, hk, 0]).reshape(BLOCK_N, BLOCK_D).to(DOT)  # (BLOCK_N, BLOCK_D)
            v = v_base.load([b, start_n, hk, 0]).reshape(BLOCK_N, BLOCK_D).to(DOT)
        else:
            kv_mask = (cols[:, None] < seq_k) & dmask[None, :]
            # (BLOCK_N, BLOCK_D)
            k = tl.load(k_base + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
            v = tl.load(v_base + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
        s = tl.dot(q, tl.trans(k), input_precision=PREC, out_dtype=ACC) * qk_scale  # (BLOCK_M, BLOCK_N)
        p = _exp(s - lse[:, None], EXP2)
        if MASKED or HAS_DOC:
            valid = _pair_mask(rows[:, None], cols[None, :], qd[:, None], kd[None, :], seq_q, seq_k, diag, MASKED,
                               CAUSAL, HAS_DOC)  # (BLOCK_M, BLOCK_N)
            p = tl.where(valid, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC, out_dtype=ACC)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(DOT), k, input_precision=PREC, out_dtype=ACC)
    return dq


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, QDOC, KDOC, qk_scale, scale, sqb, sqs, sqh, skb, sks, skh, svb,
                        svs, svh, sob, sos, soh, n_q_heads, group, seq_q, seq_k, head_dim, CAUSAL: tl.constexpr,
                        HAS_DOC: tl.constexpr, DOT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
                        EXP2: tl.constexpr, TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """Grid (q blocks, b * hq); the key loop in two parts and the blocks' order as the forward's."""
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
    q_mask = (rows[:, None] < seq_q) & dmask[None, :]
    if TMA:
        q = Q.load([b32, pid_m * BLOCK_M, h, 0]).reshape(BLOCK_M, BLOCK_D).to(DOT)  # (BLOCK_M, BLOCK_D)
        do = DO.load([b32, pid_m * BLOCK_M, h, 0]).reshape(BLOCK_M, BLOCK_D).to(DOT)
        k_base = K
        v_base = V
    else:
        q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=q_mask, other=0.0).to(DOT)
        do = tl.load(DO + b * sob + h * soh + rows[:, None] * sos + dims[None, :], mask=q_mask, other=0.0).to(DOT)
        k_base = K + b * skb + hk * skh
        v_base = V + b * svb + hk * svh
    stat = bh.to(tl.int64) * seq_q + rows
    lse = _lse_to_base(tl.load(LSE + stat, mask=rows < seq_q, other=0.0).to(ACC), EXP2)  # (BLOCK_M,)
    delta = tl.load(DELTA + stat, mask=rows < seq_q, other=0.0).to(ACC)
    kdoc = KDOC + b * seq_k
    diag = seq_k - seq_q
    dq = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    qd = tl.full((BLOCK_M,), 0, tl.int32)
    q_lo, q_hi = 0, 0
    if HAS_DOC:
        qd, q_lo, q_hi = _doc_block(QDOC + b * seq_q, rows, seq_q)
    whole, hi = _key_range(pid_m, seq_q, seq_k, CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, whole, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_base, v_base, kdoc, start_n, offs_n, rows, dims, dmask, qd, q_lo, q_hi,
                      sks, svs, seq_q, seq_k, diag, qk_scale, b32, hk, False, CAUSAL, HAS_DOC, DOT, ACC, PREC,
                      EXP2, TMA, BLOCK_N, BLOCK_D)
    for start_n in range(whole, hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_base, v_base, kdoc, start_n, offs_n, rows, dims, dmask, qd, q_lo, q_hi,
                      sks, svs, seq_q, seq_k, diag, qk_scale, b32, hk, True, CAUSAL, HAS_DOC, DOT, ACC, PREC,
                      EXP2, TMA, BLOCK_N, BLOCK_D)
    tl.store(DQ + b * sob + h * soh + rows[:, None] * sos + dims[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=q_mask)
