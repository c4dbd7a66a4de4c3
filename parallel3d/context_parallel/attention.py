"""Attention over a sequence sharded across the CP group (ring / all-gather / Ulysses).

Every mode expects the load-balanced layout of sharding.py (rank r holds chunks r and 2*cp-1-r of
2*cp chunks) and returns the output for the local queries in that same layout:

    q (b, s/cp, hq, d), k/v (b, s/cp, hk, d)  ->  out (b, s/cp, hq, d)      [hq, hk: per-TP-rank heads]

    mode        communication per layer (forward)              K/V memory per rank
    ring        cp-1 K/V blocks passed around the ring (p2p)    2 s/cp (the block in flight; the last one is kept
                                                                for the backward, which walks the ring back)
    allgather   one all-gather of K/V                           s
    ulysses     all-to-alls of q, k, v and out                  s, for hk/cp heads (needs heads % cp == 0)

CP and TP are orthogonal: the CP group links the ranks sharing a TP rank, so each attends over its own
heads. With cp == 1 this is plain (SDPA / flash) attention.

Packed documents (`documents`, documents.py): every mode also masks attention to each token's own
document; the ring skips the math of blocks no local query can see (counted in documents.counters).
"""
from __future__ import annotations

from typing import Optional

import torch

from parallel3d.kernels import dispatch
from parallel3d.comm import Group
from parallel3d.context_parallel.allgather import allgather_attention
from parallel3d.context_parallel.blocks import block_attention
from parallel3d.context_parallel.documents import Documents
from parallel3d.context_parallel.ring import ring_attention
from parallel3d.context_parallel.ulysses import ulysses_attention

CP_MODES = ("ring", "allgather", "ulysses")


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, mode: str) -> None:
    if mode not in CP_MODES:
        raise ValueError(f"unknown context-parallel mode {mode!r}; parallel.cp_mode must be one of {CP_MODES}")
    if q.dim() != 4 or k.shape != v.shape or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"expected q (b, s/cp, hq, d) and k/v (b, s/cp, hk, d); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"num_heads={q.shape[2]} is not a multiple of num_kv_heads={k.shape[2]}")
    if group.size > 1 and q.shape[1] % 2:
        raise ValueError(f"local sequence length {q.shape[1]} is odd: with cp={group.size} the sequence must be "
                         f"cut into 2*cp = {2 * group.size} equal chunks (see context_parallel.shard_sequence)")


def _check_documents(q: torch.Tensor, group: Group, documents: Optional[Documents]) -> None:
    if documents is not None and tuple(documents.ids.shape) != (q.shape[0], q.shape[1] * group.size):
        raise ValueError(f"document ids must cover the whole sequence (b, s) = {(q.shape[0], q.shape[1] * group.size)}"
                         f", got {tuple(documents.ids.shape)}")


def context_parallel_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,
                                        mode: str = "ring", causal: bool = True, backend: str = "auto",
                                        scale: Optional[float] = None, documents: Optional[Documents] = None
                                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (b, s/cp, hq, d), lse (b, hq, s/cp)) of the local queries over the whole sequence.

    Differentiable w.r.t. q, k, v through out (lse is returned for inspection / merging, not differentiated).
    """
    _check(q, k, v, group, mode)
    _check_documents(q, group, documents)
    if group.size == 1:
        doc = documents.ids if documents is not None else None
        return block_attention(q, k, v, causal, scale, backend, doc, doc)
    if mode == "ring":
        return ring_attention(q, k, v, group, causal, scale, backend, documents)
    if mode == "allgather":
        return allgather_attention(q, k, v, group, causal, scale, backend, documents)
    return ulysses_attention(q, k, v, group, causal, scale, backend, with_lse=True, documents=documents)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, mode: str = "ring",
                               causal: bool = True, backend: str = "auto", documents: Optional[Documents] = None,
                               scale: Optional[float] = None
                               ) -> torch.Tensor:
    """q (b, s/cp, hq, d), k/v (b, s/cp, hk, d) local shards (load-balanced layout) -> out (b, s/cp, hq, d).

    mode: "ring" | "allgather" | "ulysses" (ValueError otherwise). With cp == 1: local attention.
    documents: per-token document ids of the whole sequence (b, s) (documents.py), or None.
    scale: softmax scale (default d ** -0.5; MLA passes its own, see models/mla.py).
    """
    _check(q, k, v, group, mode)
    _check_documents(q, group, documents)
    if group.size == 1:
        if documents is not None:
            return dispatch.attention(q, k, v, causal=causal, scale=scale, backend=backend, doc_ids=documents.ids,
                                      doc_ids_host=documents.host, doc_derived=documents.derived)
        return dispatch.attention(q, k, v, causal=causal, scale=scale, backend=backend)
    if mode == "ulysses":
        return ulysses_attention(q, k, v, group, causal, scale, backend, with_lse=False, documents=documents)[0]
    return context_parallel_attention_with_lse(q, k, v, group, mode, causal, backend, scale, documents=documents)[0]
