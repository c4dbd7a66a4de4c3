"""Block attention pieces shared by the CP modes: forward returning (out, lse), flash-style backward from
the *merged* out/lse, the log-sum-exp merge, and a differentiable block attention.

Conventions (as kernels.flash_attention): q (b, sq, hq, d), k/v (b, sk, hk, d), hq % hk == 0 (GQA: q head
i uses kv head i // (hq/hk)); causal is bottom-right aligned (query i sees keys j <= i + sk - sq);
lse (b, hq, sq). Math runs in `acc_dtype` (fp32, or fp64 for fp64 inputs).

Merge of partial results over disjoint key sets (softmax over the union):
    lse = log(sum_i exp(lse_i))                       (torch.logaddexp, pairwise)
    out = sum_i exp(lse_i - lse) * out_i              (never a plain sum of the out_i)

Backward of one block, given the final (merged) out O and lse L of its query rows:
    P  = exp(S - L)               S = scale * Q K^T (masked entries -> P = 0)
    dV = P^T dO                   dP = dO V^T
    D  = rowsum(dO * O)           dS = P * (dP - D)
    dQ = scale * dS K             dK = scale * dS^T Q
Summed over blocks this is exactly the gradient of the full attention, because P computed with the
global L is the block's slice of the full softmax matrix.
"""
from __future__ import annotations

from typing import Optional

import torch

from parallel3d.kernels import dispatch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp64 for fp64 inputs, otherwise fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float, q_doc: Optional[torch.Tensor] = None,
            k_doc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """S = scale * Q K^T with GQA and the bottom-right causal mask (and, with document ids q_doc (b, sq) /
    k_doc (b, sk), the document mask) -> (b, hq, sq, sk) in acc dtype."""
    rep = q.shape[2] // k.shape[2]
    dt = acc_dtype(q.dtype)
    kf = k.to(dt).repeat_interleave(rep, dim=2)  # (b, sk, hq, d)
    s = torch.einsum("bqhd,bkhd->bhqk", q.to(dt), kf) * scale  # (b, hq, sq, sk)
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + (sk - sq), float("-inf"))
    if q_doc is not None:
        s = s.masked_fill(q_doc[:, None, :, None] != k_doc[:, None, None, :], float("-inf"))  # (b, 1, sq, sk)
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (rows that see no key) replaced by 0, so exp(-inf - lse) = 0 instead of nan."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


@torch.no_grad()
def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  backend: str, q_doc: Optional[torch.Tensor] = None, k_doc: Optional[torch.Tensor] = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One block: (out (b, sq, hq, d) in q.dtype, lse (b, hq, sq) in acc dtype).

    Goes through `dispatch.attention_with_lse` (kernels.attention_backend.select_attention: aten's flash op
    on CUDA and on the CPU, the Triton flash kernel where that op cannot run, with documents on CUDA or when
    forced, the exact reference for fp64).
    """
    out, lse = dispatch.attention_with_lse(q, k, v, causal, scale, backend, q_doc, k_doc)
    return out, lse.to(acc_dtype(q.dtype))


@torch.no_grad()
def block_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float, backend: str,
                   q_doc: Optional[torch.Tensor] = None, k_doc: Optional[torch.Tensor] = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq (b, sq, hq, d), dk, dv (b, sk, hk, d)) in acc dtype, this block's share of the full gradient.

    out/lse are the merged (final) values of these query rows, see the module docstring.
    """
    dt = acc_dtype(q.dtype)
    if q.is_meta:
        q_doc = k_doc = None  # the dry run plans documents as plain causal blocks (dispatch.attention_with_lse)
    impl = dispatch.select_attention(backend, q, need_lse=True, documents=q_doc is not None)
    if impl == "library":  # the meta stand-in for SDPA's CUDA op with the lse (select_attention)
        from parallel3d.kernels.attention_standin import library_lse_attention_bwd
        dq, dk, dv = library_lse_attention_bwd(do.to(q.dtype), q, k, v, out.to(q.dtype), lse.float(), causal,
                                               scale)
        return dq.to(dt), dk.to(dt), dv.to(dt)
    if impl == "triton" and q_doc is None:  # the kernel's custom op: also runs on the dry run's stand-in
        from parallel3d.kernels import ops
        dq, dk, dv = ops.flash_attention_bwd(do.to(q.dtype), q, k, v, out.to(q.dtype), lse.float(), causal, scale,
                                             None)
        return dq.to(dt), dk.to(dt), dv.to(dt)
    if impl == "triton":
        from parallel3d.kernels.flash_attention import flash_attention_backward
        dq, dk, dv = flash_attention_backward(do.to(q.dtype), q, k, v, out.to(q.dtype), lse.float(), causal, scale,
                                              q_doc=q_doc, k_doc=k_doc)
        return dq.to(dt), dk.to(dt), dv.to(dt)
    if impl == "sdpa" and q_doc is None:  # document-masked blocks take the exact reference (as in forward)
        dq, dk, dv = dispatch.sdpa_attention_backward(do, q, k, v, out, lse, causal, scale)
        return dq.to(dt), dk.to(dt), dv.to(dt)
    b, sk, hk, d = k.shape
    hq = q.shape[2]
    rep = hq // hk
    p = torch.exp(_scores(q, k, causal, scale, q_doc, k_doc) - _finite(lse.to(dt))[..., None])  # (b, hq, sq, sk)
    dof, qf = do.to(dt), q.to(dt)  # (b, sq, hq, d)
    vf = v.to(dt).repeat_interleave(rep, dim=2)  # (b, sk, hq, d)
    kf = k.to(dt).repeat_interleave(rep, dim=2)
    delta = (dof * out.to(dt)).sum(-1).transpose(1, 2)  # D = rowsum(dO * O): (b, hq, sq)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dof)  # dV = P^T dO: (b, sk, hq, d)
    dp = torch.einsum("bqhd,bkhd->bhqk", dof, vf)  # dP = dO V^T: (b, hq, sq, sk)
    ds = p * (dp - delta[..., None])  # dS = P * (dP - D)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, kf) * scale  # (b, sq, hq, d)
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, qf) * scale  # (b, sk, hq, d)
    # GQA: q heads [i*rep, (i+1)*rep) share kv head i -> sum their contributions
    return dq, dk.view(b, sk, hk, rep, d).sum(3), dv.view(b, sk, hk, rep, d).sum(3)


@torch.no_grad()
def merge_into(out: torch.Tensor, lse: torch.Tensor, out_i: torch.Tensor, lse_i: torch.Tensor) -> None:
    """In place: (out, lse) <- merge of (out, lse) with a partial (out_i, lse_i) over other keys.

    out/out_i (b, sq, hq, d), lse/lse_i (b, hq, sq).  new = logaddexp(lse, lse_i), w = exp(lse_i - new);
    exp(lse - new) * out + w * out_i = out + w * (out_i - out) (the two weights sum to 1): one lerp_ over
    out instead of two products, a sum and a copy. Rows with new = -inf (no key seen yet) give w = nan and
    keep out (0) through nan_to_num.
    """
    new = torch.logaddexp(lse, lse_i)  # (b, hq, sq)
    w = torch.exp(lse_i - new).nan_to_num_(0.0).transpose(1, 2)[..., None]  # (b, sq, hq, 1)
    out.lerp_(out_i.to(out.dtype), w)
    lse.copy_(new)


class BlockAttention(torch.autograd.Function):
    """Differentiable (out, lse) of one local attention; lse is an output but not differentiated."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                backend: str, q_doc: Optional[torch.Tensor], k_doc: Optional[torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = block_forward(q, k, v, causal, scale, backend, q_doc, k_doc)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale, backend, q_doc, k_doc)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse: Optional[torch.Tensor]):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float],
                    backend: str, q_doc: Optional[torch.Tensor] = None, k_doc: Optional[torch.Tensor] = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Local attention -> (out (b, sq, hq, d), lse (b, hq, sq)), differentiable w.r.t. q, k, v.
    q_doc (b, sq) / k_doc (b, sk): document ids (a query sees only keys of its own document)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if q_doc is not None and k_doc is None:
        k_doc = q_doc
    return BlockAttention.apply(q, k, v, causal, scale, backend, q_doc, k_doc)
