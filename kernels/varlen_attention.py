"""Causal attention over packed documents (varlen) without a dense (s x s) mask, and flash-attn's varlen entry.

Documents are given per token: doc (b, s) integer ids, nondecreasing along each row, one run of equal ids
per document (a token sees only earlier tokens of its own run). Three ways to compute it:

    varlen_sdpa          torch, cu_seqlens style: query blocks of `block` rows, each against the keys
                         from the start of the earliest document it touches to its own end (SDPA with a
                         (b, block, span) boolean mask): exact, O(block * span) memory, skips what no query
                         of the block can see
    flash_attn_varlen    the flash-attn package's `flash_attn_varlen_func` on the flattened (b*s) tokens,
                         one sequence per document (CUDA only; chosen by
                         kernels.attention_backend.select_attention)
    kernels.flash_attention with q_doc/k_doc: the Triton kernel (forward and backward with lse)

The block plan and cu_seqlens come from a host copy of the ids, so deciding what to skip never reads
the device (no sync; the meta-device dry run works).
"""
from __future__ import annotations

from typing import Optional

import torch

QUERY_BLOCK = 1024  # varlen_sdpa query rows per SDPA call (memory: b * hq * QUERY_BLOCK * span scores)


def document_starts(doc: torch.Tensor) -> torch.Tensor:
    """(b, s) -> (b, s) index of the first token of each token's document (run of equal ids)."""
    s = doc.shape[1]
    idx = torch.arange(s, device=doc.device).expand_as(doc)  # (b, s)
    new = torch.ones_like(doc, dtype=torch.bool)
    new[:, 1:] = doc[:, 1:] != doc[:, :-1]
    return torch.where(new, idx, torch.zeros_like(idx)).cummax(dim=1).values


def query_blocks(doc_host: torch.Tensor, block: int = QUERY_BLOCK) -> list[tuple[int, int, int]]:
    """[(q0, q1, k0)]: query rows [q0, q1) need keys [k0, q1) only; k0 is the start of the earliest
    document a row of the block is in (over the batch)."""
    starts = document_starts(doc_host.cpu())  # (b, s)
    s = doc_host.shape[1]
    return [(q0, min(q0 + block, s), int(starts[:, q0].min())) for q0 in range(0, s, block)]


def varlen_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor,
                blocks: list[tuple[int, int, int]], scale: Optional[float] = None) -> torch.Tensor:
    """q (b, s, hq, d), k/v (b, s, hk, d), doc (b, s) -> causal document-masked out (b, s, hq, d)
    (differentiable through SDPA). Every query sees at least itself, so no row is fully masked."""
    outs = []
    for q0, q1, k0 in blocks:
        qpos = torch.arange(q0, q1, device=q.device)[:, None]
        kpos = torch.arange(k0, q1, device=q.device)[None, :]
        mask = (doc[:, q0:q1, None] == doc[:, None, k0:q1]) & (kpos <= qpos)  # (b, bq, span)
        o = torch.nn.functional.scaled_dot_product_attention(
            q[:, q0:q1].transpose(1, 2), k[:, k0:q1].transpose(1, 2), v[:, k0:q1].transpose(1, 2),
            attn_mask=mask[:, None], scale=scale, enable_gqa=q.shape[2] != k.shape[2])  # (b, hq, bq, d)
        outs.append(o.transpose(1, 2))
    return torch.cat(outs, dim=1)  # (b, s, hq, d)


def cu_seqlens(doc_host: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(cu_seqlens (n_docs + 1,) int32, max document length) of the flattened (b*s) tokens: a sequence
    boundary wherever the id changes and at every row start."""
    b, s = doc_host.shape
    new = torch.ones(b, s, dtype=torch.bool)
    new[:, 1:] = doc_host[:, 1:].cpu() != doc_host[:, :-1].cpu()
    starts = torch.nonzero(new.reshape(-1)).reshape(-1)
    cu = torch.cat([starts, torch.tensor([b * s])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def flash_attn_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_host: torch.Tensor,
                      scale: Optional[float] = None) -> torch.Tensor:
    """Causal document-masked attention through `flash_attn_varlen_func` (one sequence per document)."""
    from flash_attn import flash_attn_varlen_func

    b, s, hq, d = q.shape
    cu, longest = cu_seqlens(doc_host)
    cu = cu.to(q.device)
    out = flash_attn_varlen_func(q.reshape(b * s, hq, d), k.reshape(b * s, k.shape[2], d),
                                 v.reshape(b * s, v.shape[2], d), cu, cu, longest, longest,
                                 softmax_scale=scale, causal=True)  # (b*s, hq, d)
    return out.reshape(b, s, hq, d)
