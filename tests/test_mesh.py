"""MeshSpec rank arithmetic, without processes."""
import itertools

import pytest

from parallel3d.mesh import DIMS, MeshSpec, ParallelContext


def _specs():
    for tp, cp, dp, pp in itertools.product([1, 2, 4], [1, 2], [1, 2, 3, 4], [1, 2, 3]):
        for ep in range(1, dp * cp + 1):
            if (dp * cp) % ep == 0:
                yield MeshSpec(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)


SPECS = list(_specs())


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_groups_partition_world_and_coords_round_trip(spec):
    world = set(range(spec.world_size))
    sizes = {"tp": spec.tp, "cp": spec.cp, "dp": spec.dp, "pp": spec.pp, "ep": spec.ep, "edp": spec.edp,
             "dp_cp": spec.dp * spec.cp,
             "world": spec.world_size}
    for dim in DIMS:
        if dim == "embedding":
            continue
        groups = spec.groups(dim)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == sorted(world), dim          # a partition: every rank exactly once
        assert all(len(g) == sizes[dim] for g in groups), dim
    for r in range(spec.world_size):
        c = spec.coords(r)
        assert spec.rank(tp=c.tp, cp=c.cp, dp=c.dp, pp=c.pp) == r


@pytest.mark.parametrize("spec", SPECS[::7], ids=str)
def test_layout_facts(spec):
    for g in spec.groups("tp"):                              # TP innermost: consecutive ranks
        assert g == list(range(g[0], g[0] + spec.tp))
    dpcp = {tuple(g) for g in spec.groups("dp_cp")}
    for g in spec.groups("ep"):                              # EP carved out of DP x CP
        assert any(set(g) <= set(d) for d in dpcp)
        assert len({spec.coords(r).pp for r in g}) == 1 and len({spec.coords(r).tp for r in g}) == 1
    for g in spec.groups("edp"):
        assert any(set(g) <= set(d) for d in dpcp)
        assert len({spec.coords(r).ep for r in g}) == 1      # same expert shard, replicated
    for g in spec.groups("embedding"):                       # first and last stage of one pipeline
        stages = sorted(spec.coords(r).pp for r in g)
        assert stages == sorted({0, spec.pp - 1})
    for g in spec.groups("pp"):                              # a pipeline keeps its tp/cp/dp coordinates
        assert [spec.coords(r).pp for r in g] == list(range(spec.pp))


def test_rank_formula_example():
    spec = MeshSpec(tp=2, cp=1, dp=2, pp=2)
    assert spec.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert spec.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert spec.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=0), "parallel.tp must be a positive integer"),
    (dict(dp=3, ep=2), "parallel.ep=2 must divide dp*cp=3*1=3"),
])
def test_invalid_specs(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        MeshSpec(**kwargs)


def test_for_world_errors_and_default_dp():
    assert MeshSpec.for_world(8, tp=2, pp=2).dp == 2
    with pytest.raises(ValueError, match="world size 6 is not divisible by tp"):
        MeshSpec.for_world(6, tp=4)
    with pytest.raises(ValueError, match="does not equal the world size"):
        MeshSpec.for_world(8, tp=2, dp=2)


def test_single_context_needs_no_distributed():
    import torch.distributed as dist

    ctx = ParallelContext.single()
    assert not dist.is_initialized()
    assert ctx.tp.size == 1 and ctx.tp.rank == 0 and ctx.is_first_stage and ctx.is_last_stage


def test_init_slices_agree_with_the_global_tensor(monkeypatch):
    """Layout-free init: any slice drawn alone equals that slice of the whole tensor (many row blocks)."""
    import torch

    import parallel3d.params as params

    monkeypatch.setattr(params, "_BLOCK_ELEMENTS", 50)
    for shape in [(37, 10), (5, 7, 3), (12,)]:
        meta = params.ParamMeta(shape, params.full_slices(shape))
        full = params.global_init_tensor(3, "w", meta, 0.02)
        assert full.std() > 0.01
        for rows in [(0, shape[0]), (3, min(20, shape[0])), (shape[0] - 1, shape[0])]:
            sl = (slice(*rows),) + params.full_slices(shape)[1:]
            if len(shape) > 1:
                sl = sl[:1] + (slice(1, shape[1] - 1),) + sl[2:]
            assert torch.equal(params.init_slice(3, "w", params.ParamMeta(shape, sl), 0.02), full[sl])
        other = params.global_init_tensor(3, "v", meta, 0.02)
        assert not torch.equal(full, other)  # the name is part of the seed


@pytest.mark.parametrize("tp,cp,dp,pp,ep,dp_shard,gpus_per_node", [
    (1, 1, 1, 1, 1, 0, 8), (2, 1, 4, 3, 2, 2, 4), (3, 2, 6, 2, 4, 2, 2), (2, 2, 4, 2, 2, 0, 8),
    (1, 2, 6, 1, 3, 3, 1), (4, 1, 2, 2, 1, 1, 8)])
def test_group_of_is_the_member_of_every_group_that_holds_the_rank(tp, cp, dp, pp, ep, dp_shard, gpus_per_node):
    """MeshSpec.group_of looks only at the ranks sharing the pinned coordinates; it must give the group that
    MeshSpec.groups (every group of the kind, the whole world walked) gives, for every kind and rank."""
    from parallel3d.mesh_spec import ALL_DIMS

    spec = MeshSpec(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, dp_shard=dp_shard, gpus_per_node=gpus_per_node)
    for dim in ALL_DIMS:
        groups = spec.groups(dim)
        for rank in range(spec.world_size):
            assert spec.group_of(dim, rank) == next((g for g in groups if rank in g), []), (dim, rank)
