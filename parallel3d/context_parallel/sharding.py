"""Load-balanced sequence sharding for context parallelism (pure functions, no communication).

Causal attention does more work for late queries than for early ones, so a plain contiguous split would
leave the last CP rank with most of the work. The sequence is instead cut into 2*cp equal chunks and rank
r holds chunks r and 2*cp-1-r (one early, one late chunk: every rank gets the same amount of work):

    seq_len = 16, cp = 2, chunk = 16 / (2*2) = 4

      global positions   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 14 15
      chunk              c0      | c1      | c2        | c3
      owner              rank 0  | rank 1  | rank 1    | rank 0

      rank 0 local seq:  c0 c3  = positions [0 1 2 3 12 13 14 15]
      rank 1 local seq:  c1 c2  = positions [4 5 6 7  8  9 10 11]

The model is told the global positions of its local tokens (`cp_chunk_indices`, the position ids RoPE
uses). Inputs and labels are split with the same `shard_sequence`, so each rank's labels line up with its
tokens. Loss normalisation stays with the caller: every rank sums its token losses and divides by the
number of target tokens of the *global* batch (not of its shard); the DP x CP gradient all-reduce (sum)
then gives exactly the single-rank gradient, whatever cp is.

With cp == 1 the layout is the identity (no divisibility requirement).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch


def check_seq_len(seq_len: int, cp: int) -> None:
    """Raise ValueError unless the sequence splits into 2*cp equal load-balanced chunks."""
    if cp < 1:
        raise ValueError(f"context parallel size must be >= 1, got cp={cp}")
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {2 * cp}: context parallelism "
                         f"cuts the sequence into 2*cp equal chunks (rank r holds chunks r and 2*cp-1-r); "
                         f"pick train.seq_len as a multiple of {2 * cp}")


def cp_chunk_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """Global positions (LongTensor (seq_len/cp,)) held by CP rank `rank`: chunk r then chunk 2*cp-1-r."""
    check_seq_len(seq_len, cp)
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} outside [0, {cp})")
    if cp == 1:
        return torch.arange(seq_len)
    c = seq_len // (2 * cp)
    late = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange(late * c, (late + 1) * c)])


def layout_permutation(seq_len: int, cp: int) -> torch.Tensor:
    """order (seq_len,): element k of the rank-order concatenation [rank 0 shard | rank 1 shard | ...]
    (what an all-gather along the sequence returns) sits at global position order[k].

        to global order:     x_global = x_rank_order.index_select(dim, order.argsort())
        to rank order:       x_rank_order = x_global.index_select(dim, order)
    """
    return torch.cat([cp_chunk_indices(seq_len, cp, r) for r in range(cp)])


def shard_sequence(x: torch.Tensor, cp_group_size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This CP rank's part of x along `dim` (token ids, labels, positions, hidden states alike)."""
    idx = cp_chunk_indices(x.shape[dim], cp_group_size, rank).to(x.device)
    return x.index_select(dim, idx)


def unshard_sequence(shards: Union[Sequence[torch.Tensor], torch.Tensor], cp_group_size: int,
                     dim: int = 1) -> torch.Tensor:
    """Inverse of `shard_sequence`: the per-rank shards (a list, rank order) or their concatenation along
    `dim` (an all-gather result) -> the tensor in global sequence order."""
    x = shards if isinstance(shards, torch.Tensor) else torch.cat(list(shards), dim=dim)
    order = layout_permutation(x.shape[dim], cp_group_size).to(x.device)
    return x.index_select(dim, order.argsort())
