"""HSDP (`parallel.dp_shard=K`): ZeRO shards over blocks of K DP ranks and replicates across dp/K blocks.

Exact like any other layout: through the real Trainer + DistributedOptimizer the losses match the
world-size-1 run (rel 1e-5) and the weights after the AdamW steps (rtol 1e-4); the checkpoint written at
one dp_shard loads at another and at world size 1; the bytes per group are those of the shapes.
"""
from __future__ import annotations

import itertools

import pytest

from ckpt_helpers import MOE, build_trainer, context_for, make_config, train
from parallel3d.mesh import MeshSpec
from parallel3d.training.config import ConfigError
from test_checkpoint import _assert_close, _assert_tiled
from test_trainer_regressions import PARITY, assert_parity


STEPS = 3


def run(worker, overrides, steps: int) -> dict:
    """Records of `steps` Trainer steps and this rank's share of the weights, read from the optimizer's
    fp32 master shards (ZeRO-3 frees the parameters; the shards of all ranks tile every tensor once)."""
    import torch

    torch.set_num_threads(1)
    cfg = make_config([*PARITY, *overrides], 1 if worker is None else worker.world_size)
    trainer = build_trainer(cfg, context_for(cfg, worker))
    records = [trainer.train_step() for _ in range(steps)]
    weights = {name[len("master/"):]: (t.clone(), slices, shape)
               for name, (t, shape, slices) in trainer.optimizer.state_tensors().items() if name.startswith("master/")}
    return {"records": records, "weights": weights}


def _hsdp_specs():
    for tp, cp, dp, pp in itertools.product([1, 2], [1, 2], [1, 2, 4, 6], [1, 2]):
        for k in range(1, dp + 1):
            for ep, etp in itertools.product(range(1, tp * dp * cp + 1), (1, 2)):
                if dp % k == 0 and (tp * k * cp) % (ep * etp) == 0:
                    yield MeshSpec(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, dp_shard=k)


@pytest.mark.parametrize("spec", list(_hsdp_specs())[::9], ids=str)
def test_shard_and_replica_groups_compose_to_the_reduction_groups(spec):
    """A sum over a shard group, then over the replica group, is the sum over DP x CP (dense) or
    expert-DP (expert): the groups partition the world, and each reduction group is a shard x replica grid."""
    k, world = spec.dp_shard, set(range(spec.world_size))
    sizes = {"dp_shard": k * spec.cp, "edp_shard": spec.tp * k * spec.cp // (spec.ep * spec.etp), "dp_rep": spec.dp // k}
    for dim, size in sizes.items():
        groups = spec.groups(dim)
        assert sorted(r for g in groups for r in g) == sorted(world), dim
        assert all(len(g) == size for g in groups), dim
    for shard_dim, full_dim in (("dp_shard", "dp_cp"), ("edp_shard", "edp")):
        for r in range(spec.world_size):
            rep = spec.group_of("dp_rep", r)
            grid = {x for m in rep for x in spec.group_of(shard_dim, m)}
            assert grid == set(spec.group_of(full_dim, r)), (shard_dim, r)
    for g in spec.groups("dp_shard"):   # K consecutive DP ranks
        dps = sorted({spec.coords(r).dp for r in g})
        assert dps == list(range(dps[0], dps[0] + k))


def test_bad_dp_shard_is_one_clear_error():
    with pytest.raises(ConfigError, match="dp_shard=3 must divide parallel.dp=4"):
        make_config(["parallel.dp_shard=3"], 4)
    with pytest.raises(ConfigError, match=r"which parallel.ep\*etp=4\*1=4 must divide"):
        make_config([*MOE, "parallel.ep=4", "parallel.dp_shard=2"], 4)
    assert make_config(["parallel.dp_shard=2"], 4).parallel.dp_shard == 2
    assert make_config([], 4).parallel.dp_shard == 0     # all of dp, whatever dp is


@pytest.fixture(scope="module")
def ref():
    return run(None, [], STEPS)


@pytest.mark.parametrize("layout", [
    ["parallel.zero=1", "parallel.dp_shard=2"],
    ["parallel.zero=2", "parallel.dp_shard=2"],
    ["parallel.zero=3", "parallel.dp_shard=2"],
    ["parallel.zero=3", "parallel.dp_shard=1"],
    ["parallel.zero=2", "parallel.tp=2", "parallel.dp_shard=1"],
    ["parallel.zero=1", "parallel.pp=2", "parallel.dp_shard=1"],
], ids=lambda x: "-".join(o.split(".")[1] for o in x))
def test_hsdp_parity_through_trainer(worlds, ref, layout):
    assert_parity(worlds.run(4, run, layout, STEPS), ref)


def test_hsdp_moe_parity(worlds):
    """Expert weights shard over the expert-DP ranks of one block and replicate across blocks."""
    ref = run(None, MOE, STEPS)
    assert_parity(worlds.run(4, run, [*MOE, "parallel.ep=2", "parallel.zero=3", "parallel.dp_shard=2"], STEPS),
                  ref)


def _bytes(worker, overrides):
    cfg = make_config(["parallel.bucket_size_mb=0.01", *overrides], worker.world_size)
    trainer = build_trainer(cfg, context_for(cfg, worker))
    rec = trainer.train_step()
    shapes = [tuple(p.shape) for chunk in trainer.chunks for p in chunk.parameters()]
    buckets = [[tuple(s.shape) for s in b.slots] for b in trainer.optimizer.buckets]
    return rec["comm_bytes"], shapes, buckets


@pytest.mark.parametrize("zero", [1, 3])
def test_hsdp_comm_bytes_per_group(worlds, zero):
    """dp=4 dp_shard=2: the reduce-scatter (and the parameter all-gathers) move the K-padded bucket
    inside the shard group (ZeRO-1: contiguous, padded at its end to K x 64 elements; ZeRO-3: K-row chunks); the replicas all-reduce one segment (1/K of it); nothing goes over dp_cp but the
    scalars (token count, loss)."""
    k = 2
    for comm_bytes, shapes, buckets in worlds.run(4, _bytes, [f"parallel.zero={zero}", f"parallel.dp_shard={k}"]):
        def numel(shape, chunk=1):
            rows, row = (shape[0], 1) if shape else (1, 1)
            for n in shape[1:]:
                row *= n
            return -(-rows // chunk) * chunk * row
        assert sorted(s for b in buckets for s in b) == sorted(shapes)
        if zero == 3:
            full = sum(numel(s, k) * 4 for b in buckets for s in b)
        else:
            full = sum(-(-sum(numel(s) for s in b) // (k * 64)) * k * 64 * 4 for b in buckets)
        assert comm_bytes["dp_shard.reduce_scatter"] == full
        assert comm_bytes["dp_rep.all_reduce"] == full // k
        gathers = 1 if zero == 1 else 2      # ZeRO-3: forward and backward
        assert comm_bytes["dp_shard.all_gather"] == gathers * full
        assert comm_bytes["dp_cp.all_reduce"] == 2 * 4   # token count + loss (fp32 scalars)
        assert not any(key.startswith(("dp_cp.reduce", "dp_cp.all_gather")) for key in comm_bytes)


def test_checkpoint_reshards_between_dp_shard_values(worlds, tmp_path):
    """Saved at dp=4 dp_shard=2 (ZeRO-2), loaded at dp_shard=4 (ZeRO-3), dp_shard=1 and world size 1."""
    steps, save_at, layout = 6, 3, ["parallel.zero=2", "parallel.dp_shard=2"]
    ref = train(None, [], steps)
    root = str(tmp_path / "ckpt")
    full = worlds.run(4, train, layout, steps, root, (save_at,))[0]
    _assert_close(full, ref, 1e-5, "hsdp saving run vs world size 1")
    _assert_tiled(f"{root}/step_{save_at:08d}")
    for other in (["parallel.zero=3", "parallel.dp_shard=4"], ["parallel.zero=1", "parallel.dp_shard=1"]):
        got = worlds.run(4, train, other, steps, None, (), root)[0]
        _assert_close(got, ref[save_at:], 1e-4, f"resumed under {other}")
    _assert_close(train(None, [], steps, load=root), ref[save_at:], 1e-4, "resumed at world size 1")


@pytest.mark.parametrize("zero", [2, 3])
def test_hsdp_step_runs_off_the_cpu(zero):
    """The meta-device stand-in for CUDA (tests/test_fake_device.py): every HSDP collective gets device tensors."""
    from parallel3d.mesh import ParallelContext

    cfg = make_config([f"parallel.zero={zero}", "parallel.dp_shard=2", "parallel.tp=2"], 8)
    p = cfg.parallel
    ctx = ParallelContext.simulated(MeshSpec(tp=p.tp, dp=p.dp, dp_shard=p.dp_shard), 5, "meta")
    out = build_trainer(cfg, ctx).train_step()
    assert not out["skipped"]
    assert {"dp_shard.reduce_scatter", "dp_shard.all_gather", "dp_rep.all_reduce"} <= set(out["comm_bytes"])


def test_hsdp_and_hpz_through_the_command_line(tmp_path):
    """launch/pretrain.py under torchrun: dp=4 dp_shard=2 ZeRO-3 with hpZ (2 ranks per node) logs the
    world-size-1 losses, and its JSONL rows show the shard, replica and node groups' traffic."""
    import json

    from test_launch import SMALL, _run, assert_log_parity

    logs = [tmp_path / "ws1.jsonl", tmp_path / "hsdp.jsonl"]
    _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", *SMALL, f"log.jsonl={logs[0]}"])
    _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", "parallel.zero=3",
          "parallel.dp_shard=2", "parallel.zero_hpz=true", "parallel.gpus_per_node=2", *SMALL,
          f"log.jsonl={logs[1]}"], nproc=4)
    assert_log_parity(logs[1], logs[0])
    keys = set(json.loads(open(logs[1]).readline())["comm_bytes"])
    assert {"dp_shard.all_gather", "dp_shard.reduce_scatter", "dp_rep.all_reduce"} <= keys, keys
