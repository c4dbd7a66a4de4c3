"""Context parallelism: the sequence split over `cp` ranks (load-balanced for causal attention).

    shard_sequence / cp_chunk_indices     rank r holds chunks r and 2*cp-1-r of 2*cp equal chunks
    context_parallel_attention            ring (default) / allgather / ulysses attention over the CP group
    Documents / document_ids              packed documents: per-token document ids for masked attention
"""
from parallel3d.context_parallel.allgather import allgather_attention
from parallel3d.context_parallel.attention import (CP_MODES, context_parallel_attention,
                                                   context_parallel_attention_with_lse)
from parallel3d.context_parallel.documents import Documents, document_ids, document_positions
from parallel3d.context_parallel.ring import block_plan, ring_attention
from parallel3d.context_parallel.sharding import (check_seq_len, cp_chunk_indices, layout_permutation,
                                                  shard_sequence, unshard_sequence)
from parallel3d.context_parallel.ulysses import check_ulysses_heads, ulysses_attention

__all__ = ["CP_MODES", "context_parallel_attention", "context_parallel_attention_with_lse", "ring_attention",
           "allgather_attention", "ulysses_attention", "block_plan", "check_seq_len", "check_ulysses_heads",
           "cp_chunk_indices", "Documents", "document_ids", "document_positions", "layout_permutation",
           "shard_sequence", "unshard_sequence"]
