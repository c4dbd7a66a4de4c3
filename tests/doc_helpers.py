"""Shared helpers for the packed-document tests: the per-document reference loss.

The reference evaluates every document of every window alone: a separate forward pass of the
world-size-1 model over that document's tokens only, positions 0..len-1, no mask other than causal.
Masked attention over the packed window must give the same summed token loss.
"""
from __future__ import annotations

import torch

from parallel3d.models.llama import Llama
from parallel3d.mesh import ParallelContext


def doc_spans(ids_row: torch.Tensor, eos_id: int) -> list[tuple[int, int]]:
    """[(start, end)] of the documents of one window of input ids: a document ends with its EOS."""
    spans, start = [], 0
    for t, tok in enumerate(ids_row.tolist()):
        if tok == eos_id:
            spans.append((start, t + 1))
            start = t + 1
    if start < len(ids_row):
        spans.append((start, len(ids_row)))
    return spans


@torch.no_grad()
def per_document_loss_sum(model: Llama, windows: torch.Tensor, eos_id: int) -> tuple[float, int]:
    """(summed token loss, target count) of (b, s+1) token windows, every document alone."""
    total, count = 0.0, 0
    for row in windows:
        ids, labels = row[:-1], row[1:]
        for a, b in doc_spans(ids, eos_id):
            pos = torch.arange(b - a)
            total += float(model(ids[None, a:b], pos, labels[None, a:b]))
            count += b - a
    return total, count


def reference_model(cfg) -> Llama:
    """The world-size-1 model with the Trainer's initial weights (a function of seed and names)."""
    model = Llama(cfg.model, ParallelContext.single())
    model.init_weights(cfg.train.seed)
    return model
