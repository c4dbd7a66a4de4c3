"""Load-balanced sequence sharding and the ring's per-block causal plan (pure, no processes)."""
from __future__ import annotations

import pytest
import torch

from parallel3d.context_parallel import (block_plan, check_ulysses_heads, cp_chunk_indices, layout_permutation,
                                         shard_sequence, unshard_sequence)


def test_rank_holds_chunks_r_and_mirror():
    # seq 16, cp 2: chunks of 4; rank 0 -> c0 c3, rank 1 -> c1 c2
    assert cp_chunk_indices(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_chunk_indices(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert cp_chunk_indices(8, 4, 3).tolist() == [3, 4]
    assert cp_chunk_indices(7, 1, 0).tolist() == list(range(7))  # cp = 1: identity, any length
    assert cp_chunk_indices(16, 2, 0).dtype == torch.long


@pytest.mark.parametrize("cp,seq", [(1, 6), (2, 12), (4, 24), (4, 40)])
def test_shards_partition_the_sequence_and_round_trip(cp, seq):
    allpos = torch.cat([cp_chunk_indices(seq, cp, r) for r in range(cp)])
    assert sorted(allpos.tolist()) == list(range(seq))
    assert torch.equal(layout_permutation(seq, cp), allpos)
    x = torch.randn(2, seq, 3)
    labels = torch.arange(seq).expand(2, seq)
    shards = [shard_sequence(x, cp, r) for r in range(cp)]
    assert torch.equal(unshard_sequence(shards, cp), x)
    assert torch.equal(unshard_sequence(torch.cat(shards, 1), cp), x)  # all-gather result works too
    for r in range(cp):  # inputs and labels split the same way: the label of a token stays with it
        assert torch.equal(shard_sequence(labels, cp, r)[0], cp_chunk_indices(seq, cp, r))
    y = torch.randn(3, 2, seq)
    assert torch.equal(unshard_sequence([shard_sequence(y, cp, r, dim=2) for r in range(cp)], cp, dim=2), y)


def test_sequence_not_divisible_by_2cp_is_a_clear_error():
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by 2\*cp = 8"):
        cp_chunk_indices(30, 4, 0)
    with pytest.raises(ValueError, match=r"sequence length 6 is not divisible by 2\*cp = 4"):
        shard_sequence(torch.zeros(1, 6), 2, 0)
    with pytest.raises(ValueError, match="CP rank 2 outside"):
        cp_chunk_indices(8, 2, 2)


def _plan_mask(rank: int, src: int, cp: int, c: int, causal: bool) -> torch.Tensor:
    """(2c, 2c) bool: which (local query, src's local key) pairs the plan lets attend."""
    mask = torch.zeros(2 * c, 2 * c, dtype=torch.bool)
    for (q0, q1), (k0, k1), blk_causal in block_plan(rank, src, cp, causal):
        sq, sk = (q1 - q0) * c, (k1 - k0) * c
        block = torch.ones(sq, sk, dtype=torch.bool)
        if blk_causal:  # bottom-right aligned: query i sees key j <= i + sk - sq
            block = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        assert not mask[q0 * c:q1 * c, k0 * c:k1 * c].any(), "blocks overlap"
        mask[q0 * c:q1 * c, k0 * c:k1 * c] = block
    return mask


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_block_plan_is_exact_over_global_positions(cp, causal):
    """Union over ring steps of the planned blocks == the global causal (or full) mask, no pair twice."""
    c = 3
    seq = 2 * cp * c
    for rank in range(cp):
        qpos = cp_chunk_indices(seq, cp, rank)
        seen = torch.zeros(2 * c, seq, dtype=torch.int64)
        for src in range(cp):
            kpos = cp_chunk_indices(seq, cp, src)
            m = _plan_mask(rank, src, cp, c, causal)
            want = kpos[None, :] <= qpos[:, None] if causal else torch.ones_like(m)
            assert torch.equal(m, want), (rank, src)
            seen[:, kpos] += m.long()
        assert seen.max() <= 1


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_ring_work_is_balanced(cp):
    """Every rank computes the same number of (query, key) block entries at every step (2c^2 in chunks^2)."""
    for step in range(cp):
        work = set()
        for rank in range(cp):
            plan = block_plan(rank, (rank - step) % cp, cp, True)
            work.add(sum((q1 - q0) * (k1 - k0) for (q0, q1), (k0, k1), _ in plan))
        assert work == {4 if step == 0 else 2}


def test_ulysses_head_rules():
    assert check_ulysses_heads(8, 4, 4) == 1
    assert check_ulysses_heads(8, 2, 4) == 2  # kv heads replicated 2x
    with pytest.raises(ValueError, match="num_heads=6, num_kv_heads=2, cp=4"):
        check_ulysses_heads(6, 2, 4)
    with pytest.raises(ValueError, match="num_heads=8, num_kv_heads=3, cp=2"):
        check_ulysses_heads(8, 3, 2)
