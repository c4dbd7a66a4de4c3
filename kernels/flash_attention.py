"""Scaled dot-product attention returning the log-sum-exp (so ring attention can merge blocks)."""
from __future__ import annotations

from typing import Optional

import torch


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, sq, hq, d), k/v (b, sk, hk, d) with hq % hk == 0 (GQA) -> out (b, sq, hq, d), lse (b, hq, sq) fp32.

    Causal masking is bottom-right aligned: query i sees keys j <= i + (sk - sq).
    Rows that see no key get out = 0 and lse = -inf.
    """
    b, sq, hq, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    rep = hq // hk
    kf = k.float().repeat_interleave(rep, dim=2)  # (b, sk, hq, d)
    vf = v.float().repeat_interleave(rep, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale  # (b, hq, sq, sk)
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (sk - sq), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (b, hq, sq)
    probs = torch.exp(scores - lse[..., None].clamp_min(torch.finfo(torch.float32).min))
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
