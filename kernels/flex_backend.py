"""FlexAttention (torch.nn.attention.flex_attention) as an attention backend: model.attention=flex.

TorchTitan's path for packed documents. The mask is a `BlockMask` built from the document ids: blocks of
128 x 128 (query, key) positions that no query may see are skipped, the partial ones are masked per element
by `causal_document`, so a batch of short documents costs what its documents cost, not a full causal square.

    calls                                 what runs
    without the lse, documents or not     flex_attention (compiled on CUDA: eager runs the dense math
                                          reference), causal / document-causal block mask
    with the lse (CP ring / all-gather    as model.attention=auto (kernels/attention_backend.py): the
    blocks, Ulysses with the lse)         blocks merge through their lse and backpropagate through the merge

Training needs CUDA: torch has no FlexAttention backward on the CPU (`check_flex`). A forward without
gradients runs on the CPU (eager), which is how the tests hold it to the reference.

The document mask is built once per microbatch: `Documents.derived` (parallel3d/context_parallel/documents.py)
keeps it for every layer and for the recompute of activation checkpointing.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch

FLEX_MASK_KEY = "flex_block_mask"  # the BlockMask's key in a Documents' `derived` dict


def check_flex(device: torch.device, needs_grad: bool) -> None:
    """Raise the one error a run with model.attention=flex gets where FlexAttention cannot run: torch has no
    FlexAttention backward on the CPU."""
    if needs_grad and device.type == "cpu":
        raise ValueError("model.attention=flex cannot run here: torch's FlexAttention has no backward on the CPU; "
                         "train with model.attention=flex on CUDA, or use model.attention=auto here")


def _flex():
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention


@lru_cache(maxsize=None)
def _compiled():
    """flex_attention compiled once per process (dynamic=False: one kernel per shape, as TorchTitan)."""
    return torch.compile(_flex(), dynamic=False)


@lru_cache(maxsize=None)
def _block_mask_builder(device_type: str):
    """create_block_mask, compiled once per process on CUDA (as TorchTitan builds its masks): eager, it first
    materialises the dense (b, sq, sk) boolean mask, 4 GiB for one 64K-token sequence, where the compiled
    one reduces the mask to its blocks as it evaluates it. Eager on the CPU (forward-only tests, small)."""
    from torch.nn.attention.flex_attention import create_block_mask
    return torch.compile(create_block_mask, dynamic=False) if device_type == "cuda" else create_block_mask


def document_block_mask(doc: torch.Tensor):
    """BlockMask of causal attention within each document, for doc (b, s) integer ids on the compute device."""
    def causal_document(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])
    b, s = doc.shape
    return _block_mask_builder(doc.device.type)(causal_document, b, None, s, s, device=doc.device)


@lru_cache(maxsize=8)
def causal_block_mask(sq: int, sk: int, device: str):
    """BlockMask of causal attention, bottom-right aligned (sk >= sq: a query sees the keys up to its own
    position counted from the end), as the other backends align it."""
    offset = sk - sq

    def causal(b, h, q_idx, kv_idx):
        return q_idx + offset >= kv_idx
    return _block_mask_builder(torch.device(device).type)(causal, None, None, sq, sk, device=device)


def flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: Optional[float],
                   doc: Optional[torch.Tensor] = None, derived: Optional[dict] = None) -> torch.Tensor:
    """q (b, sq, hq, d), k/v (b, sk, hk, d) -> out (b, sq, hq, d). doc (b, s): packed-document ids (causal
    within each document; sq == sk); `derived`: the microbatch's dict that keeps the document mask."""
    if doc is not None:
        if derived is None:
            mask = document_block_mask(doc)
        else:
            mask = derived.get(FLEX_MASK_KEY)
            if mask is None:
                mask = derived[FLEX_MASK_KEY] = document_block_mask(doc)
    elif causal:
        mask = causal_block_mask(q.shape[1], k.shape[1], str(q.device))
    else:
        mask = None
    run = _compiled() if q.is_cuda else _flex()
    out = run(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=mask, scale=scale,
              enable_gqa=q.shape[2] != k.shape[2])  # (b, hq, sq, d)
    return out.transpose(1, 2)  # (b, sq, hq, d)
