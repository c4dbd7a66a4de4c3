"""Ulysses (DeepSpeed) context parallelism: all-to-all from sequence-sharded to head-sharded and back.

    before: rank r holds every head of its tokens      q (b, s/cp, hq, d)
    all-to-all (scatter heads, gather sequence)  ->    q (b, s, hq/cp, d)   heads [r*hq/cp, (r+1)*hq/cp)
    reorder the gathered sequence to global order, full (causal) attention over the whole sequence
    reorder back, all-to-all (scatter sequence, gather heads)  ->  out (b, s/cp, hq, d)

Heads are split contiguously, so with GQA rank r's q heads use exactly its kv heads. Requires hq % cp
== 0 and hk % cp == 0 (local, per-TP-rank head counts). When hk < cp and cp % hk == 0, each kv head is
replicated cp/hk times before the all-to-all (so every rank receives the one kv head its q heads use;
the replicas' gradients are summed by autograd); this costs cp/hk times the K/V volume.
"""
from __future__ import annotations

from typing import Optional

import torch

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.context_parallel.blocks import block_attention
from parallel3d.context_parallel.documents import Documents
from parallel3d.context_parallel.sharding import layout_permutation
from parallel3d.kernels import dispatch


def check_ulysses_heads(hq: int, hk: int, cp: int) -> int:
    """Validate head counts; returns the kv-head replication factor (1 when hk % cp == 0)."""
    if hq % cp == 0 and hk % cp == 0:
        return 1
    if hq % cp == 0 and cp % hk == 0:
        return cp // hk
    raise ValueError(f"ulysses context parallelism needs the local head counts divisible by cp: num_heads={hq}, "
                     f"num_kv_heads={hk}, cp={cp} (num_heads % cp == 0 and num_kv_heads % cp == 0, or cp % "
                     f"num_kv_heads == 0 to replicate kv heads); use parallel.cp_mode=ring or allgather instead")


def _seq_to_heads(x: torch.Tensor, group: Group, to_global: torch.Tensor) -> torch.Tensor:
    """(b, s/cp, h, d) sequence-sharded -> (b, s, h/cp, d) head-sharded, sequence in global order."""
    cp = group.size
    b, s, h, d = x.shape
    send = x.reshape(b, s, cp, h // cp, d).permute(2, 0, 1, 3, 4)  # (cp dest, b, s/cp, h/cp, d)
    recv = comm.all_to_all_autograd(send.contiguous(), group)  # (cp src, b, s/cp, h/cp, d)
    full = recv.permute(1, 0, 2, 3, 4).reshape(b, cp * s, h // cp, d)  # (b, s, h/cp, d) rank order
    return full.index_select(1, to_global)


def _heads_to_seq(x: torch.Tensor, group: Group, to_rank: torch.Tensor) -> torch.Tensor:
    """Inverse of `_seq_to_heads`: (b, s, h/cp, d) global order -> (b, s/cp, h, d)."""
    cp = group.size
    b, s, hl, d = x.shape
    send = x.index_select(1, to_rank).reshape(b, cp, s // cp, hl, d).transpose(0, 1)  # (cp dest, b, s/cp, h/cp, d)
    recv = comm.all_to_all_autograd(send.contiguous(), group)  # (cp src = head group, b, s/cp, h/cp, d)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // cp, cp * hl, d)  # (b, s/cp, h, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, causal: bool = True,
                      scale: Optional[float] = None, backend: str = "auto", with_lse: bool = True,
                      documents: Optional[Documents] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """-> (out (b, s/cp, hq, d), lse (b, hq, s/cp) or None); differentiable w.r.t. q, k, v.
    documents: document ids of the whole sequence (global order: what each rank attends over here).

    lse costs one extra all-to-all, so it is only returned when `with_lse`.
    """
    cp = group.size
    b, s_local, hq, d = q.shape
    rep = check_ulysses_heads(hq, k.shape[2], cp)
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)  # (b, s/cp, cp, d)
    order = layout_permutation(s_local * cp, cp).to(q.device)
    to_global = order.argsort()
    qh = _seq_to_heads(q, group, to_global)  # (b, s, hq/cp, d)
    kh = _seq_to_heads(k, group, to_global)  # (b, s, hk/cp, d)
    vh = _seq_to_heads(v, group, to_global)
    doc = documents.ids if documents is not None else None  # (b, s)
    if not with_lse:
        # no lse wanted: the kernel plain attention takes (on CUDA SDPA's own call, faster than its ops that
        # return the lse, which a block takes: kernels/attention_backend.py); with documents its varlen forms
        # (flash-attn's, FlexAttention's, block-wise SDPA), each rank over the whole sequence
        docs = {} if documents is None else {"doc_ids": doc, "doc_ids_host": documents.host,
                                             "doc_derived": documents.derived}
        out = dispatch.attention(qh, kh, vh, causal=causal, scale=scale, backend=backend, **docs)  # (b, s, hq/cp, d)
        return _heads_to_seq(out, group, order), None  # (b, s/cp, hq, d)
    out, lse = block_attention(qh, kh, vh, causal, scale, backend, doc, doc)  # (b, s, hq/cp, d), (b, hq/cp, s)
    out = _heads_to_seq(out, group, order)  # (b, s/cp, hq, d)
    if not with_lse:
        return out, None
    lse = _heads_to_seq(lse.transpose(1, 2)[..., None], group, order)  # (b, s/cp, hq, 1)
    return out, lse[..., 0].transpose(1, 2).contiguous()  # (b, hq, s/cp)
