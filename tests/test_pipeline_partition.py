"""Layer partitioning over pipeline stages: balance, embedding/head costs, user lists, errors."""
import itertools

import pytest

from parallel3d.pipeline import balanced_counts, partition_layers


def sizes(parts):
    return [len(p) for p in parts]


def check_contiguous(parts, num_layers):
    assert [i for p in parts for i in p] == list(range(num_layers))


def test_even_split():
    parts = partition_layers(8, 4, embedding_cost=0, head_cost=0)
    assert parts == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert partition_layers(5, 1) == [[0, 1, 2, 3, 4]]


def test_not_divisible():
    for num_layers, pp in [(10, 4), (7, 3), (13, 5), (9, 2)]:
        parts = partition_layers(num_layers, pp, embedding_cost=0, head_cost=0)
        check_contiguous(parts, num_layers)
        assert max(sizes(parts)) - min(sizes(parts)) <= 1


def test_embedding_and_head_balance():
    assert sizes(partition_layers(10, 4)) == [2, 3, 3, 2]  # costs 3, 3, 3, 3
    assert sizes(partition_layers(8, 2)) == [4, 4]
    assert sizes(partition_layers(6, 4)) == [1, 2, 2, 1]
    assert sizes(partition_layers(10, 4, embedding_cost=2, head_cost=0)) == [1, 3, 3, 3]
    assert sizes(partition_layers(4, 4)) == [1, 1, 1, 1]  # ties: no stage left empty
    half = partition_layers(9, 3, embedding_cost=0.5, head_cost=0.5)
    assert sizes(half) == [3, 3, 3]


def test_balance_is_optimal_against_brute_force():
    for num_layers in range(1, 9):
        for stages in range(1, min(num_layers + 2, 5) + 1):
            for emb, head in [(0, 0), (1, 1), (2, 0.5)]:
                extra = [0.0] * stages
                extra[0] += emb
                extra[-1] += head
                best = min(max(e + n for e, n in zip(extra, c))
                           for c in itertools.product(range(num_layers + 1), repeat=stages)
                           if sum(c) == num_layers
                           and all(n > 0 for n in c[1:-1]))
                got = balanced_counts(num_layers, stages, emb, head)
                assert max(e + n for e, n in zip(extra, got)) == best
                assert sum(got) == num_layers and all(n > 0 for n in got[1:-1])


def test_virtual_stages_in_global_order():
    parts = partition_layers(16, 2, v=2)  # 4 stages: rank 0 holds stages 0 and 2
    assert sizes(parts) == [4, 4, 4, 4]  # stage costs 5, 4, 4, 5: no better split exists
    check_contiguous(parts, 16)
    assert sizes(partition_layers(8, 2, v=2, embedding_cost=0, head_cost=0)) == [2, 2, 2, 2]


def test_end_stages_may_hold_only_embedding_or_head():
    assert partition_layers(2, 4) == [[], [0], [1], []]
    assert partition_layers(1, 2) == [[0], []]
    assert partition_layers(3, 2, layers_per_stage=[0, 3]) == [[], [0, 1, 2]]


def test_user_list():
    assert partition_layers(6, 3, layers_per_stage=[1, 3, 2]) == [[0], [1, 2, 3], [4, 5]]
    assert partition_layers(4, 2, v=2, layers_per_stage=[1, 1, 1, 1]) == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="sums to 5, but the model has 6 layers"):
        partition_layers(6, 3, layers_per_stage=[1, 2, 2])
    with pytest.raises(ValueError, match="has 2 entries but there are 3"):
        partition_layers(6, 3, layers_per_stage=[3, 3])
    with pytest.raises(ValueError, match=r"layers_per_stage\[1\] = 0"):
        partition_layers(6, 3, layers_per_stage=[3, 0, 3])
    with pytest.raises(ValueError, match=r"layers_per_stage\[0\] = -1"):
        partition_layers(6, 3, layers_per_stage=[-1, 4, 3])
    with pytest.raises(ValueError, match="integer"):
        partition_layers(6, 3, layers_per_stage=[2.0, 2, 2])


def test_errors():
    with pytest.raises(ValueError, match=r"cannot split 1 layers into 4 pipeline stages"):
        partition_layers(1, 4)
    with pytest.raises(ValueError, match=r"pp=2 x v=4"):
        partition_layers(4, 2, v=4)
    for kwargs in [dict(num_layers=0, pp=1), dict(num_layers=4, pp=0),
                   dict(num_layers=4, pp=2, v=0)]:
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            partition_layers(**kwargs)
    with pytest.raises(ValueError, match=">= 0"):
        partition_layers(4, 2, embedding_cost=-1)
