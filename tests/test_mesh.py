"""MeshSpec rank arithmetic, without processes."""
import itertools

import pytest

from parallel3d.mesh import DIMS, MeshSpec, ParallelContext


def _specs():
    for tp, cp, dp, pp in itertools.product([1, 2, 4], [1, 2], [1, 2, 3, 4], [1, 2, 3]):
        stage = tp * cp * dp
        for ep, etp in itertools.product(range(1, stage + 1), (1, 2, 4)):
            if stage % (ep * etp) == 0:
                yield MeshSpec(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp)


SPECS = list(_specs())


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_groups_partition_world_and_coords_round_trip(spec):
    world = set(range(spec.world_size))
    sizes = {"tp": spec.tp, "cp": spec.cp, "dp": spec.dp, "pp": spec.pp, "ep": spec.ep, "edp": spec.edp,
             "etp": spec.etp, "dp_cp": spec.dp * spec.cp,
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
    assert spec.edp * spec.ep * spec.etp == spec.tp * spec.cp * spec.dp
    for g in spec.groups("etp"):                             # etp innermost: consecutive ranks of one stage
        assert g == list(range(g[0], g[0] + spec.etp)) and len({spec.coords(r).pp for r in g}) == 1
    for dim in ("ep", "edp"):                                # folded over the TP x CP x DP ranks of a stage
        for g in spec.groups(dim):
            assert len({spec.coords(r).pp for r in g}) == 1
    for g in spec.groups("edp"):                             # same expert slice (ep, etp), replicated
        assert len({(spec.coords(r).ep, spec.coords(r).etp) for r in g}) == 1
    for g in spec.groups("ep"):                              # one of each expert shard, same ffn slice
        assert sorted(spec.coords(r).ep for r in g) == list(range(spec.ep))
        assert len({(spec.coords(r).etp, spec.coords(r).edp) for r in g}) == 1
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
    (dict(dp=3, ep=2), "parallel.ep*etp=2*1=2 must divide tp*cp*dp=1*1*3=3"),
    (dict(tp=2, dp=2, ep=4, etp=2), "parallel.ep*etp=4*2=8 must divide tp*cp*dp=2*1*2=4"),
    (dict(etp=0), "parallel.etp must be a positive integer"),
    (dict(tp=2, dp=4, ep=4, etp=2, dp_shard=1), "which parallel.ep*etp=4*2=8 must divide"),
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


@pytest.mark.parametrize("tp,cp,dp,pp,ep,dp_shard,gpus_per_node,etp", [
    (1, 1, 1, 1, 1, 0, 8, 1), (2, 1, 4, 3, 2, 2, 4, 2), (3, 2, 6, 2, 4, 2, 2, 3), (2, 2, 4, 2, 2, 0, 8, 2),
    (1, 2, 6, 1, 3, 3, 1, 1), (4, 1, 2, 2, 1, 1, 8, 4), (2, 1, 4, 3, 4, 2, 4, 1), (2, 2, 4, 2, 4, 0, 8, 2),
    (4, 1, 2, 1, 2, 1, 2, 2), (2, 2, 2, 2, 8, 0, 4, 1)])
def test_group_of_is_the_member_of_every_group_that_holds_the_rank(tp, cp, dp, pp, ep, dp_shard, gpus_per_node,
                                                                   etp):
    """MeshSpec.group_of looks only at the ranks sharing the pinned coordinates; it must give the group that
    MeshSpec.groups (every group of the kind, the whole world walked) gives, for every kind and rank."""
    from parallel3d.mesh_spec import ALL_DIMS

    spec = MeshSpec(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, dp_shard=dp_shard, gpus_per_node=gpus_per_node, etp=etp)
    for dim in ALL_DIMS:
        groups = spec.groups(dim)
        for rank in range(spec.world_size):
            assert spec.group_of(dim, rank) == next((g for g in groups if rank in g), []), (dim, rank)


def test_folding_example_world8_tp2_dp4_ep4():
    """docs/parallelism.md's diagram: EP spans the TP and DP ranks, expert-DP pairs the two EP groups."""
    spec = MeshSpec(tp=2, dp=4, ep=4)
    assert spec.groups("etp") == [[r] for r in range(8)]
    assert spec.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert spec.groups("edp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert spec.edp == 2
    spec = MeshSpec(tp=2, cp=2, dp=2, pp=2, ep=2, etp=2)   # world 16: etp pairs, ep strides over them
    assert spec.groups("etp")[:4] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert spec.groups("ep")[:4] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert spec.groups("edp")[:4] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert spec.group_of("ep", 13) == [13, 15] and spec.group_of("edp", 13) == [9, 13]


@pytest.mark.parametrize("spec", [s for s in SPECS if s.etp == s.tp and (s.dp * s.cp) % s.ep == 0][::5], ids=str)
def test_etp_equal_tp_is_the_layout_before_folding(spec):
    """etp == tp: the etp groups are the tp groups and EP / expert-DP are runs / strides of the DP x CP ranks
    that share (tp, pp), indexed j = cp + cp_size * dp (the pre-folding rule, written out independently)."""
    assert spec.groups("etp") == spec.groups("tp")
    for r in range(spec.world_size):
        c = spec.coords(r)
        j = c.cp + spec.cp * c.dp
        peers = [q for q in range(spec.world_size)
                 if (spec.coords(q).tp, spec.coords(q).pp) == (c.tp, c.pp)]
        index = {q: spec.coords(q).cp + spec.cp * spec.coords(q).dp for q in peers}
        assert spec.group_of("ep", r) == [q for q in peers if index[q] // spec.ep == j // spec.ep]
        assert spec.group_of("edp", r) == [q for q in peers if index[q] % spec.ep == j % spec.ep]
        assert (c.ep, c.edp, c.etp) == (j % spec.ep, j // spec.ep, c.tp)


def test_expert_hsdp_groups_tile_expert_dp():
    """HSDP for experts: the expert shard group is the expert-DP ranks of one block, the replica group is the
    dense one, and shard x replicas is the expert-DP group (a sum over edp = shard sum, then replica sum)."""
    spec = MeshSpec(tp=2, dp=4, ep=2, etp=1, dp_shard=2)   # block: 2*2 = 4 ranks, fold ep*etp = 2
    assert spec.groups("edp_shard") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert spec.groups("dp_rep") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    for r in range(spec.world_size):
        shard, reps = spec.group_of("edp_shard", r), spec.group_of("dp_rep", r)
        union = sorted({q for s in shard for q in spec.group_of("dp_rep", s)})
        assert union == spec.group_of("edp", r)
        position = shard.index(r)   # replicas hold the same shard position
        assert all(spec.group_of("edp_shard", q).index(q) == position for q in reps)
