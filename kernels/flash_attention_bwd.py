"""Flash-attention backward (FlashAttention-2 style): recompute the probabilities from the forward's lse.

One kernel for delta = rowsum(dO * O) (minus dlse when lse itself gets a gradient), one for dK/dV (one
program per key block and kv head, looping over the q heads that share it, so GQA needs no atomics) and one
for dQ (flash_attention_dq.py); the launcher runs the three. Conventions and document masking as kernels/flash_attention.py, which holds the forward, the torch
twins and the autograd wrapper. Gradient maths, with P = exp(S * scale - lse), delta_i = sum_d dO_id O_id:

    dV = P^T dO        dP = dO V^T        dS = P * (dP - delta)        dQ = scale * dS K     dK = scale * dS^T Q
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from parallel3d.kernels._flash_common import (_check, _doc_block, _docs, _exp, _kernel_dtypes, _lse_to_base,
                                              _pair_mask, _prep, delta_block_m, key_rows_form, launch_config,
                                              logit_scale, tile_operand, use_tma)
from parallel3d.kernels._triton_utils import cdiv, next_pow2
from parallel3d.kernels.flash_attention_dq import _attn_bwd_dq_kernel


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


# dK, dV for one key block of one kv head, summed over the `group` q heads that read it (GQA), logits in the
# kernel's base (`_exp`, qk_scale = scale * log2(e) with EXP2; lse converted once per row):
#   P = exp(scale * Q K^T - lse),  dV = sum_h P^T dO,  dP = dO V^T,  dS = P * (dP - delta),
#   dK = scale * sum_h dS^T Q.     Causal: only q blocks from the first row that sees this key block.
# KEY_ROWS computes it transposed, key rows first: P^T = exp(scale * K Q^T - lse^T), dP^T = V dO^T,
# dS^T = P^T * (dP^T - delta^T), so every product has the key block's BLOCK_N rows (Hopper's warpgroup MMA
# wants 64, whatever BLOCK_M is) and P^T, dS^T feed dV, dK from registers with no transpose of a register
# tile; K and V are then left operands, held in registers for the whole loop, which only some tiles afford
# (`_flash_common.KEY_ROWS_16BIT`). Otherwise query rows first, as written above.
@triton.jit
def _dkdv_step(dk, dv, k, v, q_base, do_base, LSE, DELTA, QDOC, stat_base, start_m, offs_m, cols, dims, dmask, kd,
               k_lo, k_hi, sqs, sos, seq_q, seq_k, diag, qk_scale, b, h, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
               HAS_DOC: tl.constexpr, DOT: tl.constexpr, ACC: tl.constexpr, PREC: tl.constexpr, EXP2: tl.constexpr,
               TMA: tl.constexpr, KEY_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """One q block's share of dK/dV. MASKED: causal pairs above the diagonal are dropped. Unmasked steps need
    no bounds masks: rows past seq_q load q = dO = 0 (P^T dO and dS^T Q add nothing) and keys past seq_k are
    never stored. TMA: q_base / do_base are descriptors of the whole Q / dO, boxes at (b, start_m, h, 0).
    k: K (BLOCK_N, BLOCK_D) in the key-rows form, K^T (BLOCK_D, BLOCK_N) in the query-rows one."""
    rows = start_m + offs_m  # (BLOCK_M,)
    qd = tl.full(offs_m.shape, 0, tl.int32)
    visit = True
    if HAS_DOC:
        qd, q_lo, q_hi = _doc_block(QDOC, rows, seq_q)
        visit = (k_hi >= q_lo) & (k_lo <= q_hi)  # skip q blocks sharing no document with the keys
    if visit:
        if TMA:
            q = q_base.load([b, start_m, h, 0]).reshape(BLOCK_M, BLOCK_D).to(DOT)  # (BLOCK_M, BLOCK_D)
            do = do_base.load([b, start_m, h, 0]).reshape(BLOCK_M, BLOCK_D).to(DOT)
        else:
            q_mask = (rows[:, None] < seq_q) & dmask[None, :]
            # (BLOCK_M, BLOCK_D)
            q = tl.load(q_base + rows[:, None] * sqs + dims[None, :], mask=q_mask, other=0.0).to(DOT)
            do = tl.load(do_base + rows[:, None] * sos + dims[None, :], mask=q_mask, other=0.0).to(DOT)
        lse = _lse_to_base(tl.load(LSE + stat_base + rows, mask=rows < seq_q, other=0.0).to(ACC), EXP2)  # (BLOCK_M,)
        delta = tl.load(DELTA + stat_base + rows, mask=rows < seq_q, other=0.0).to(ACC)
        if KEY_ROWS:
            s_t = tl.dot(k, tl.trans(q), input_precision=PREC, out_dtype=ACC) * qk_scale  # (BLOCK_N, BLOCK_M)
            p_t = _exp(s_t - lse[None, :], EXP2)  # (BLOCK_N, BLOCK_M)
            if MASKED or HAS_DOC:
                p_t = tl.where(_pair_mask(rows[None, :], cols[:, None], qd[None, :], kd[:, None], seq_q, seq_k, diag,
                                          MASKED, CAUSAL, HAS_DOC), p_t, 0.0)
            dv += tl.dot(p_t.to(DOT), do, input_precision=PREC, out_dtype=ACC)  # (BLOCK_N, BLOCK_D)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PREC, out_dtype=ACC)  # (BLOCK_N, BLOCK_M)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(DOT), q, input_precision=PREC, out_dtype=ACC)  # (BLOCK_N, BLOCK_D)
        else:
            s = tl.dot(q, k, input_precision=PREC, out_dtype=ACC) * qk_scale  # (BLOCK_M, BLOCK_N); k is K^T
            p = _exp(s - lse[:, None], EXP2)  # (BLOCK_M, BLOCK_N)
            if MASKED or HAS_DOC:
                p = tl.where(_pair_mask(rows[:, None], cols[None, :], qd[:, None], kd[None, :], seq_q, seq_k, diag,
                                        MASKED, CAUSAL, HAS_DOC), p, 0.0)
            dv += tl.dot(tl.trans(p.to(DOT)), do, input_precision=PREC, out_dtype=ACC)  # (BLOCK_N, BLOCK_D)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC, out_dtype=ACC)  # (BLOCK_M, BLOCK_N)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(DOT)), q, input_precision=PREC, out_dtype=ACC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, QDOC, KDOC, qk_scale, scale, sqb, sqs, sqh, skb, sks,
                          skh, svb, svs, svh, sob, sos, soh, sdb, sds, sdh, n_k_heads, group, seq_q, seq_k,
                          head_dim, CAUSAL: tl.constexpr, HAS_DOC: tl.constexpr, DOT: tl.constexpr,
                          ACC: tl.constexpr, PREC: tl.constexpr, EXP2: tl.constexpr, TMA: tl.constexpr,
                          KEY_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Grid (key blocks, b * hk). Causal: the q blocks crossing this key block's diagonal run masked, the
    ones below it (every row sees every key of the block) unmasked; the first key blocks see the most
    queries, so the grid's natural order already issues the longest programs first. TMA: Q, K, V, dO are
    tensor descriptors (`_flash_common.tile_operand`)."""
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b32 = bhk // n_k_heads  # TMA coordinates are 32-bit; pointer offsets 64-bit
    b = b32.to(tl.int64)
    hk = bhk % n_k_heads
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
    offs_m = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims < head_dim
    kv_mask = (cols[:, None] < seq_k) & dmask[None, :]  # (BLOCK_N, BLOCK_D)
    if TMA:
        k = K.load([b32, pid_n * BLOCK_N, hk, 0]).reshape(BLOCK_N, BLOCK_D).to(DOT)  # (BLOCK_N, BLOCK_D)
        v = V.load([b32, pid_n * BLOCK_N, hk, 0]).reshape(BLOCK_N, BLOCK_D).to(DOT)
    else:
        k = tl.load(K + b * skb + hk * skh + cols[:, None] * sks + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
        v = tl.load(V + b * svb + hk * svh + cols[:, None] * svs + dims[None, :], mask=kv_mask, other=0.0).to(DOT)
    if not KEY_ROWS:
        k = tl.trans(k)  # (BLOCK_D, BLOCK_N): the query-rows form's right operand, transposed once
    dk = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    dv = tl.zeros((BLOCK_N, BLOCK_D), ACC)
    diag = seq_k - seq_q
    lo = 0      # the first q block with a row that sees a key of this block (row + diag >= first key)
    whole = 0   # the first q block whose first row sees the block's last key: from there on, no mask
    if CAUSAL:
        lo = (tl.maximum(pid_n * BLOCK_N - diag, 0) // BLOCK_M) * BLOCK_M
        whole = tl.maximum(lo, tl.cdiv(tl.maximum(pid_n * BLOCK_N + BLOCK_N - 1 - diag, 0), BLOCK_M) * BLOCK_M)
        whole = tl.minimum(whole, tl.cdiv(seq_q, BLOCK_M) * BLOCK_M)
    kd = tl.full((BLOCK_N,), 0, tl.int32)
    k_lo, k_hi = 0, 0
    if HAS_DOC:
        kd, k_lo, k_hi = _doc_block(KDOC + b * seq_k, cols, seq_k)
    qdoc = QDOC + b * seq_q
    for h in range(hk * group, hk * group + group):
        if TMA:
            q_base = Q
            do_base = DO
        else:
            q_base = Q + b * sqb + h * sqh
            do_base = DO + b * sob + h * soh
        stat_base = (b * (n_k_heads * group) + h) * seq_q
        for start_m in range(lo, whole, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, LSE, DELTA, qdoc, stat_base, start_m, offs_m, cols,
                                dims, dmask, kd, k_lo, k_hi, sqs, sos, seq_q, seq_k, diag, qk_scale, b32, h, True,
                                CAUSAL, HAS_DOC, DOT, ACC, PREC, EXP2, TMA, KEY_ROWS, BLOCK_M, BLOCK_D)
        for start_m in range(whole, seq_q, BLOCK_M):
            dk, dv = _dkdv_step(dk, dv, k, v, q_base, do_base, LSE, DELTA, qdoc, stat_base, start_m, offs_m, cols,
                                dims, dmask, kd, k_lo, k_hi, sqs, sos, seq_q, seq_k, diag, qk_scale, b32, h, False,
                                CAUSAL, HAS_DOC, DOT, ACC, PREC, EXP2, TMA, KEY_ROWS, BLOCK_M, BLOCK_D)
    out_off = b * sdb + hk * sdh + cols[:, None] * sds + dims[None, :]
    tl.store(DK + out_off, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + out_off, dv.to(DV.dtype.element_ty), mask=kv_mask)


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
    kv_bm, kv_bn, kv_warps, kv_stages = launch_config("dkdv", d, q.dtype, q.device, block_m, block_n)
    bm, bn, warps, stages = launch_config("dq", d, q.dtype, q.device, block_m, block_n)
    bd = next_pow2(max(d, 16))
    kd = _kernel_dtypes(q)
    delta = torch.empty_like(lse)  # (b, hq, sq)
    dlse_arg = dlse.contiguous() if dlse is not None else lse
    delta_m = delta_block_m(d)
    _attn_bwd_delta_kernel[(cdiv(sq, delta_m), b * hq)](
        out, do, dlse_arg, delta, hq, sq, d, HAS_DLSE=dlse is not None, ACC=kd["ACC"], BLOCK_M=delta_m,
        BLOCK_D=bd, num_warps=4)
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3])
    qd, kdoc = _docs(q_doc, k_doc, q)
    has_doc = q_doc is not None
    scales = (logit_scale(scale, q), scale)
    tma = use_tma("dkdv", d, q.device, q, k, v, do)
    _attn_bwd_dkdv_kernel[(cdiv(sk, kv_bn), b * hk)](
        *(tile_operand(x, rows, bd, tma) for x, rows in ((q, kv_bm), (k, kv_bn), (v, kv_bn), (do, kv_bm))),
        lse, delta, dk, dv, qd, kdoc, *scales, *strides, *dk.stride()[:3], hk, hq // hk, sq, sk, d,
        CAUSAL=causal, HAS_DOC=has_doc, **kd, TMA=tma, KEY_ROWS=key_rows_form(d, q.dtype, q.device), BLOCK_M=kv_bm,
        BLOCK_N=kv_bn, BLOCK_D=bd, num_warps=kv_warps, num_stages=kv_stages)
    tma = use_tma("dq", d, q.device, q, k, v, do)
    _attn_bwd_dq_kernel[(cdiv(sq, bm), b * hq)](
        *(tile_operand(x, rows, bd, tma) for x, rows in ((q, bm), (k, bn), (v, bn), (do, bm))),
        lse, delta, dq, qd, kdoc, *scales, *strides, hq, hq // hk, sq, sk, d,
        CAUSAL=causal, HAS_DOC=has_doc, **kd, TMA=tma, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, num_warps=warps,
        num_stages=stages)
    return dq, dk, dv
