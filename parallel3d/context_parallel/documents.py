"""Packed documents of one microbatch: per-token document ids for document-masked attention.

A document ends with its EOS token (the EOS belongs to the document it ends). In a window of input ids

    ids    a  b  EOS  c  d  EOS  EOS  e
    doc    0  0  0    1  1  1    2    3        doc[t] = number of EOS among ids[:t]
    pos    0  1  2    0  1  2    0    0        (data.reset_positions: restart at each document start)

With masking a token attends only to earlier tokens of its own document inside the window. The first
document of a window may have started before it (its positions start at 0 at the window start: the
window is all the model sees), and with no EOS at all the window is one document (plain causal).

Ids are nondecreasing along the sequence, so a block of keys shares no document with a block of queries
exactly when their id ranges do not meet: kernels and the ring skip such blocks without looking inside.

`Documents` carries the ids of the *whole* sequence in global order (b, s) — a few bytes per token, so
every CP rank holds them all and takes what it needs (its own shard for its queries, the owner's shard
for a ring step's keys) without communication — on the compute device and on the host. Host copies make
every skip decision (ring steps, SDPA block plans, flash-attn cu_seqlens) without a device sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from parallel3d.context_parallel.sharding import cp_chunk_indices
from parallel3d.host_sync import upload


def document_ids(ids: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(b, s) input ids -> (b, s) int64 document index per token (starting at 0 in every row)."""
    is_eos = (ids == eos_id).long()  # (b, s)
    return torch.cumsum(is_eos, dim=1) - is_eos


def document_positions(doc: torch.Tensor) -> torch.Tensor:
    """(b, s) document ids -> (b, s) position of each token inside its document (0 at each start)."""
    from parallel3d.kernels.varlen_attention import document_starts
    idx = torch.arange(doc.shape[1], device=doc.device).expand_as(doc)
    return idx - document_starts(doc)


@dataclass
class Documents:
    """Per-token document ids of a microbatch's whole sequence (global order), device and host copies.

    `counters` is filled by the attention that uses it (tests and benchmarks read it):
    ring_blocks / ring_blocks_skipped: block attentions planned / skipped as entirely masked (forward);
    ring_steps_skipped: ring steps whose every block was skipped (forward).
    `derived` keeps what an attention backend builds from the ids once per microbatch for every layer (and
    the recompute): FlexAttention's block mask (kernels/flex_backend.py).
    """
    ids: torch.Tensor                       # (b, s) int32 on the compute device
    host: torch.Tensor                      # (b, s) int64 on the host
    counters: dict = field(default_factory=dict)
    derived: dict = field(default_factory=dict)

    @classmethod
    def from_host(cls, host: torch.Tensor, device: torch.device | str = "cpu") -> "Documents":
        return cls(upload(host.to(torch.int32), device),  # pinned, non-blocking: no host sync
                   host.to(torch.int64).cpu())

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def local(self, cp: int, rank: int, host: bool = False) -> torch.Tensor:
        """(b, s/cp) ids of CP rank `rank`'s shard (load-balanced layout, sharding.py)."""
        x = self.host if host else self.ids
        return x.index_select(1, cp_chunk_indices(x.shape[1], cp, rank).to(x.device))


def any_shared(q_doc: torch.Tensor, k_doc: torch.Tensor) -> bool:
    """Host check: may some query of q_doc (b, sq) see some key of k_doc (b, sk) by document?
    Exact for nondecreasing ids where all keys precede all queries (ranges meet only at one id, shared by
    the last key and the first query), conservative otherwise (never says False wrongly)."""
    if q_doc.numel() == 0 or k_doc.numel() == 0:
        return False
    meet = (k_doc.max(1).values >= q_doc.min(1).values) & (k_doc.min(1).values <= q_doc.max(1).values)
    return bool(meet.any())


def build_documents(ids: torch.Tensor, eos_id: Optional[int], device: torch.device | str
                    ) -> Documents:
    """Documents of a (b, s) window of input ids (host tensor)."""
    return Documents.from_host(document_ids(ids, eos_id), device)
