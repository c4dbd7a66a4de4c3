"""Scaled dot-product attention returning the log-sum-exp (so ring attention can merge blocks).

Why our own kernel: ring attention needs, per block, the output *and* its lse (b, hq, sq) in fp32 and a
backward that takes the merged (global) out/lse. SDPA returns no lse. The Triton kernels here are
FlashAttention-2 style: forward streams key blocks with an online softmax; backward recomputes the
probabilities from lse, one kernel for dK/dV (one program per key block and kv head, looping over the
q heads that share it, so GQA needs no atomics) and one for dQ.

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

from kernels._triton_utils import acc_dtype, dot_dtype, interpreting, next_pow2


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
def _doc_block(DOC, idx, n):
    """Document ids of positions idx (< n valid) and their [min, max] over the valid ones. Ids are >= 0;
    padding rows get -1 so they match no key (keys pad with -2)."""
    d = tl.load(DOC + idx, mask=idx < n, other=-1)  # (BLOCK,) int32
    lo = tl.min(tl.where(idx < n, d, 2147483647), axis=0)
    hi = tl.max(d, axis=0)
    return d, lo, hi


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, QDOC, KDOC, scale, sqb, sqs, sqh, skb, sks, skh, svb, svs, svh, sob, sos,
                     soh, n_q_heads, group, seq_q, seq_k, head_dim, CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr,
                     DOT: tl.constexpr,
                     ACC: tl.constexpr, PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """Grid (q blocks, b * hq): online softmax over key blocks; out = acc / l, lse = m + log(l).
    HAS_DOC: QDOC (b, sq) / KDOC (b, sk) int32 document ids; a query sees only keys of its own document,
    and a key block whose id range misses the query block's is skipped."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_q_heads).to(tl.int64)
    h = bh % n_q_heads
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :],
                mask=(rows[:, None] < seq_q) & dmask[None, :], other=0.0).to(DOT)  # (BLOCK_M, BLOCK_D)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    diag = seq_k - seq_q
    m_i = tl.full((BLOCK_M,), float("-inf"), ACC)
    l_i = tl.zeros((BLOCK_M,), ACC)
    acc = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    qd = tl.full((BLOCK_M,), 0, tl.int32)
    q_lo, q_hi = 0, 0
    if HAS_DOC:
        qd, q_lo, q_hi = _doc_block(QDOC + b * seq_q, rows, seq_q)
    hi = seq_k
    if CAUSAL:
        hi = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M + diag)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,)
        kd = tl.full((BLOCK_N,), 0, tl.int32)
        visit = True
        if HAS_DOC:
            kd, k_lo, k_hi = _doc_block(KDOC + b * seq_k, cols, seq_k)
            visit = (k_hi >= q_lo) & (k_lo <= q_hi)  # the id ranges meet: some pair may share a document
        if visit:
            k_t = tl.load(k_base + cols[None, :] * sks + dims[:, None],
                          mask=dmask[:, None] & (cols[None, :] < seq_k), other=0.0).to(DOT)  # (BLOCK_D, BLOCK_N)
            s = tl.dot(q, k_t, input_precision=PREC, out_dtype=ACC) * scale  # (BLOCK_M, BLOCK_N)
            valid = (cols[None, :] < seq_k) & (rows[:, None] < seq_q)
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None] + diag)
            if HAS_DOC:
                valid = valid & (qd[:, None] == kd[None, :])
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # row fully masked so far
            p = tl.exp(s - m_safe[:, None])  # (BLOCK_M, BLOCK_N)
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + cols[:, None] * svs + dims[None, :],
                        mask=(cols[:, None] < seq_k) & dmask[None, :], other=0.0).to(DOT)  # (BLOCK_N, BLOCK_D)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PREC, out_dtype=ACC)
            m_i = m_new
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]  # (BLOCK_M, BLOCK_D)
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))  # (BLOCK_M,)
    tl.store(O + b * sob + h * soh + rows[:, None] * sos + dims[None, :], out.to(O.dtype.element_ty),
             mask=(rows[:, None] < seq_q) & dmask[None, :])
    tl.store(LSE + bh.to(tl.int64) * seq_q + rows, lse, mask=rows < seq_q)


# Backward preprocessing: delta_i = sum_d dO_id * O_id - dlse_i. It is the row term of the softmax
# Jacobian: dS_ij = P_ij * (dP_ij - delta_i) where dP = dO V^T; the dlse term comes from
# d lse_i / d S_ij = P_ij. O, DO share the contiguous (b, sq, hq, d) layout; DELTA is (b, hq, sq).
@triton.jit
def _attn_bwd_delta_kernel(O, DO, DLSE, DELTA, n_q_heads, seq_q, head_dim, HAS_DLSE: tl.constexpr,
                           ACC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    b = bh // n_q_heads
    h = bh % n_q_heads
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < seq_q) & (dims[None, :] < head_dim)
    off = ((b * seq_q + rows[:, None]) * n_q_heads + h) * head_dim + dims[None, :]  # (BLOCK_M, BLOCK_D)
    o = tl.load(O + off, mask=mask, other=0.0).to(ACC)
    do = tl.load(DO + off, mask=mask, other=0.0).to(ACC)
    delta = tl.sum(o * do, axis=1)  # (BLOCK_M,)
    if HAS_DLSE:
        delta -= tl.load(DLSE + bh * seq_q + rows, mask=rows < seq_q, other=0.0).to(ACC)
    tl.store(DELTA + bh * seq_q + rows, delta, mask=rows < seq_q)


# dK, dV for one key block of one kv head, summed over the `group` q heads that read it (GQA):
#   P = exp(scale * Q K^T - lse),  dV = sum_h P^T dO,  dP = dO V^T,  dS = P * (dP - delta),
#   dK = scale * sum_h dS^T Q.     Causal: only q blocks from the first row that sees this key block.
@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, QDOC, KDOC, scale, sqb, sqs, sqh, skb, sks, skh,
                          svb, svs, svh, sob, sos, soh, sdb, sds, sdh, n_k_heads, group, seq_q, seq_k,
                          head_dim, CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, DOT: tl.constexpr,
                          ACC: tl.constexpr,
                          PREC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // n_k_heads).to(tl.int64)
    hk = bhk % n_k_heads
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
    offs_m = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    kv_mask = (cols[:, None] < seq_k) & dmask[None, :]  # (BLOCK_N, BLOCK_D)
    k = tl.load(K + b * skb + hk * skh + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
    v = tl.load(V + b * svb + hk * svh + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
    k_t = tl.trans(k)  # (BLOCK_D, BLOCK_N)
    dk = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    diag = seq_k - seq_q
    lo = 0
    if CAUSAL:
        lo = (tl.maximum(pid_n * BLOCK_N - diag, 0) // BLOCK_M) * BLOCK_M
    kd = tl.full((BLOCK_N,), 0, tl.int32)
    k_lo, k_hi = 0, 0
    if HAS_DOC:
        kd, k_lo, k_hi = _doc_block(KDOC + b * seq_k, cols, seq_k)
    for h in range(hk * group, hk * group + group):
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sob + h * soh
        stat_base = (b * (n_k_heads * group) + h) * seq_q
        for start_m in range(lo, seq_q, BLOCK_M):
            rows = start_m + offs_m  # (BLOCK_M,)
            qd = tl.full((BLOCK_M,), 0, tl.int32)
            visit = True
            if HAS_DOC:
                qd, q_lo, q_hi = _doc_block(QDOC + b * seq_q, rows, seq_q)
                visit = (k_hi >= q_lo) & (k_lo <= q_hi)  # skip q blocks sharing no document with the keys
            if visit:
                q_mask = (rows[:, None] < seq_q) & dmask[None, :]
                q = tl.load(q_base + rows[:, None] * sqs + dims[None, :], mask=q_mask, other=0.0).to(DOT)
                do = tl.load(do_base + rows[:, None] * sos + dims[None, :], mask=q_mask, other=0.0).to(DOT)
                lse = tl.load(LSE + stat_base + rows, mask=rows < seq_q, other=0.0).to(ACC)  # (BLOCK_M,)
                delta = tl.load(DELTA + stat_base + rows, mask=rows < seq_q, other=0.0).to(ACC)
                s = tl.dot(q, k_t, input_precision=PREC, out_dtype=ACC) * scale  # (BLOCK_M, BLOCK_N)
                valid = (rows[:, None] < seq_q) & (cols[None, :] < seq_k)
                if CAUSAL:
                    valid = valid & (cols[None, :] <= rows[:, None] + diag)
                if HAS_DOC:
                    valid = valid & (qd[:, None] == kd[None, :])
                p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)  # (BLOCK_M, BLOCK_N)
                dv += tl.dot(tl.trans(p.to(DOT)), do, input_precision=PREC, out_dtype=ACC)
                dp = tl.dot(do, tl.trans(v), input_precision=PREC, out_dtype=ACC)  # (BLOCK_M, BLOCK_N)
                ds = p * (dp - delta[:, None])
                dk += tl.dot(tl.trans(ds.to(DOT)), q, input_precision=PREC, out_dtype=ACC)
    out_off = b * sdb + hk * sdh + cols[:, None] * sds + dims[None, :]
    tl.store(DK + out_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


# dQ for one q block of one q head: dQ = scale * sum_j dS_ij K_j over the visible key blocks, with
# dS = P * (dO V^T - delta) as above. DQ shares the contiguous layout of DO.
@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, QDOC, KDOC, scale, sqb, sqs, sqh, skb, sks, skh, svb, svs,
                        svh, sob, sos, soh, n_q_heads, group, seq_q, seq_k, head_dim, CAUSAL: tl.constexpr,
                        HAS_DOC: tl.constexpr, DOT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // n_q_heads).to(tl.int64)
    h = bh % n_q_heads
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    offs_n = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    q_mask = (rows[:, None] < seq_q) & dmask[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=q_mask, other=0.0).to(DOT)
    do = tl.load(DO + b * sob + h * soh + rows[:, None] * sos + dims[None, :], mask=q_mask, other=0.0).to(DOT)
    stat = bh.to(tl.int64) * seq_q + rows
    lse = tl.load(LSE + stat, mask=rows < seq_q, other=0.0).to(ACC)  # (BLOCK_M,)
    delta = tl.load(DELTA + stat, mask=rows < seq_q, other=0.0).to(ACC)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    diag = seq_k - seq_q
    dq = tl.zeros((BLOCK_M, BLOCK_D), ACC)
    qd = tl.full((BLOCK_M,), 0, tl.int32)
    q_lo, q_hi = 0, 0
    if HAS_DOC:
        qd, q_lo, q_hi = _doc_block(QDOC + b * seq_q, rows, seq_q)
    hi = seq_k
    if CAUSAL:
        hi = tl.minimum(seq_k, (pid_m + 1) * BLOCK_M + diag)
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n  # (BLOCK_N,)
        kd = tl.full((BLOCK_N,), 0, tl.int32)
        visit = True
        if HAS_DOC:
            kd, k_lo, k_hi = _doc_block(KDOC + b * seq_k, cols, seq_k)
            visit = (k_hi >= q_lo) & (k_lo <= q_hi)
        if visit:
            kv_mask = (cols[:, None] < seq_k) & dmask[None, :]
            k = tl.load(k_base + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
            v = tl.load(v_base + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
            s = tl.dot(q, tl.trans(k), input_precision=PREC, out_dtype=ACC) * scale  # (BLOCK_M, BLOCK_N)
            valid = (rows[:, None] < seq_q) & (cols[None, :] < seq_k)
            if CAUSAL:
                valid = valid & (cols[None, :] <= rows[:, None] + diag)
            if HAS_DOC:
                valid = valid & (qd[:, None] == kd[None, :])
            p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC, out_dtype=ACC)  # (BLOCK_M, BLOCK_N)
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(DOT), k, input_precision=PREC, out_dtype=ACC)
    tl.store(DQ + b * sob + h * soh + rows[:, None] * sos + dims[None, :], (dq * scale).to(DQ.dtype.element_ty),
             mask=q_mask)


def _config(d: int, dtype: torch.dtype, block_m: Optional[int], block_n: Optional[int], backward: bool
            ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), chosen on paper from the ahead-of-time compile report
    (benchmarks/kernel_report.py; RESULTS.md "Kernels on sm_80 / sm_90"): bf16/fp16 tiles that use tensor
    cores and spill nothing on sm_80 and sm_90, the best occupancy among those. No autotune (it needs a GPU)."""
    if interpreting():
        bm, bn, warps, stages = 16, 16, 4, 1
    elif backward:  # dK/dV and dQ tiles: the largest that keep registers < 255 with no spill on sm_80/90
        bm, bn = (64, 32) if d <= 64 else (32, 64) if d <= 128 else (16, 32)
        warps, stages = (4 if d <= 64 else 8), 2
    else:           # (128, 64) spilled on sm_90 (160 B at d=64, 24 B at d=128: benchmarks/kernel_report.py)
        bm, bn = (64, 32) if d <= 64 else (64, 64) if d <= 128 else (32, 32)
        warps, stages = (4 if d <= 64 else 8), (3 if d <= 64 else 2)
    if dtype in (torch.float32, torch.float64) and not interpreting():
        bm, bn = max(bm // 2, 16), max(bn // 2, 16)
        if backward:  # fp32 dK/dV kept 32-560 B on the stack at 255 registers: narrower key tiles, 8 warps
            bn, warps = (16 if d > 64 else bn), 8
    return (next_pow2(block_m) if block_m else bm), (next_pow2(block_n) if block_n else bn), warps, stages


def _prep(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"expected q (b, sq, hq, d), k/v (b, sk, hk, d); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads {q.shape[2]} not a multiple of kv heads {k.shape[2]}")


def _docs(q_doc: Optional[torch.Tensor], k_doc: Optional[torch.Tensor], q: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel arguments for document ids: contiguous int32 (b, sq) / (b, sk), or q itself as an unused
    placeholder pointer when there are none (HAS_DOC=False). Ids must be >= 0 (padding uses -1 / -2).
    Block skipping compares id ranges, so it is only a shortcut; the per-pair equality test is exact."""
    if q_doc is None:
        if k_doc is not None:
            raise ValueError("k_doc given without q_doc")
        return q, q
    k_doc = q_doc if k_doc is None else k_doc
    if q_doc.shape != q.shape[:2]:
        raise ValueError(f"q_doc must be (b, sq) = {tuple(q.shape[:2])}, got {tuple(q_doc.shape)}")
    return q_doc.to(torch.int32).contiguous(), k_doc.to(torch.int32).contiguous()


def _kernel_dtypes(q: torch.Tensor) -> dict:
    return dict(DOT=dot_dtype(q.dtype), ACC=acc_dtype(q.dtype),
                PREC="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32")


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
    bm, bn, warps, stages = _config(d, q.dtype, block_m, block_n, backward=False)
    qd, kd = _docs(q_doc, k_doc, q)
    _attn_fwd_kernel[(triton.cdiv(sq, bm), b * hq)](
        q, k, v, out, lse, qd, kd, scale, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        hq, hq // hk, sq, sk, d, CAUSAL=causal, HAS_DOC=q_doc is not None, **_kernel_dtypes(q), BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_D=next_pow2(max(d, 16)), num_warps=warps, num_stages=stages)
    return out, lse


def flash_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             out: torch.Tensor, lse: torch.Tensor, causal: bool = True,
                             scale: Optional[float] = None, dlse: Optional[torch.Tensor] = None,
                             block_m: Optional[int] = None, block_n: Optional[int] = None,
                             q_doc: Optional[torch.Tensor] = None, k_doc: Optional[torch.Tensor] = None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels -> (dq, dk, dv) in the input dtypes.

    out/lse may be the *merged* output and lse of a ring-attention step (then this block's share of the
    gradient comes out: P = exp(S - lse_global), delta = rowsum(dO * O_global)). dlse (b, hq, sq): the
    gradient flowing into lse, if any.
    """
    _check(q, k, v)
    q, k, v = _prep(q), _prep(k), _prep(v)
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    do, out, lse = do.contiguous(), out.contiguous(), lse.contiguous()  # do/out/dq: (b, sq, hq, d)
    dq = torch.empty_like(do, dtype=q.dtype)  # (b, sq, hq, d)
    dk = torch.zeros((b, sk, hk, d), dtype=k.dtype, device=k.device)  # (b, sk, hk, d)
    dv = torch.zeros((b, sk, hk, d), dtype=v.dtype, device=v.device)
    if b * sq * hq == 0 or sk == 0:
        return dq.zero_(), dk, dv
    bm, bn, warps, stages = _config(d, q.dtype, block_m, block_n, backward=True)
    bd = next_pow2(max(d, 16))
    kd = _kernel_dtypes(q)
    delta = torch.empty_like(lse)  # (b, hq, sq)
    dlse_arg = dlse.contiguous() if dlse is not None else lse
    _attn_bwd_delta_kernel[(triton.cdiv(sq, bm), b * hq)](
        out, do, dlse_arg, delta, hq, sq, d, HAS_DLSE=dlse is not None, ACC=kd["ACC"], BLOCK_M=bm,
        BLOCK_D=bd, num_warps=warps)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    qd, kdoc = _docs(q_doc, k_doc, q)
    has_doc = q_doc is not None
    _attn_bwd_dkdv_kernel[(triton.cdiv(sk, bn), b * hk)](
        q, k, v, do, lse, delta, dk, dv, qd, kdoc, scale, *strides, *dk.stride()[:3], hk, hq // hk, sq, sk, d,
        CAUSAL=causal, HAS_DOC=has_doc, **kd, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, num_stages=stages)
    _attn_bwd_dq_kernel[(triton.cdiv(sq, bm), b * hq)](
        q, k, v, do, lse, delta, dq, qd, kdoc, scale, *strides, hq, hq // hk, sq, sk, d,
        CAUSAL=causal, HAS_DOC=has_doc, **kd, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps, num_stages=stages)
    return dq, dk, dv


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
