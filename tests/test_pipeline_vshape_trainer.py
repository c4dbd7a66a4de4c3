"""ZB-V and DualPipe-V through the real Trainer + DistributedOptimizer: parity with world size 1.

Each case trains 3 steps (gradient clipping on, so the global norm must count the tied embedding once)
and compares with the world-size-1 run of the same config: losses and grad norms rel 1e-5 per step,
weights after the AdamW steps rtol 1e-4 (atol 1e-5; tests/parity.py), and the evaluation loss. With the
V placement the embedding and the tied head both live on pipeline rank 0 (stages 0 and 2p-1), so their
gradients are summed on that rank instead of over the embedding group.
"""
from __future__ import annotations

import pytest
import torch

from ckpt_helpers import build_trainer, context_for, make_config
from parity import WEIGHT_ATOL, assemble, assert_close_dicts, assert_grad_norms, double_every_gradient, local_slices

PARITY = ["train.lr=3e-3", "train.eps=1e-4", "train.warmup_steps=0", "train.lr_schedule=constant",
          "train.grad_clip=0.05"]
MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "model.aux_loss_coef=0.5",
       "model.z_loss_coef=0.1"]
STEPS = 3


def run(worker, overrides) -> dict:
    torch.set_num_threads(1)
    cfg = make_config([*PARITY, *overrides], 1 if worker is None else worker.world_size)
    trainer = build_trainer(cfg, context_for(cfg, worker))
    records = [trainer.train_step() for _ in range(STEPS)]
    weights = {}
    for chunk in trainer.chunks:
        weights.update(local_slices(chunk, "data"))
    eval_loss, _ = trainer.evaluate(trainer.dataset, 1)
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records],
            "weights": weights, "eval": eval_loss, "stages": trainer.stage_ids}


def assert_parity(got: list[dict], ref: dict) -> None:
    for rank in got:  # loss and norm are all-reduced: every rank reports them
        assert rank["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert rank["eval"] == pytest.approx(ref["eval"], rel=1e-5)
    assert_grad_norms([rank["norms"] for rank in got], ref["norms"], rtol=1e-5)
    assert ref["norms"][0] > 0.05, "clipping must be active for the norm to matter"
    weights, expected = assemble([x["weights"] for x in got]), assemble([ref["weights"]])
    if "lm_head.weight" in weights and "lm_head.weight" not in expected:  # the tied copy of the head
        weights["embed.weight (tied copy)"] = weights.pop("lm_head.weight")
        expected["embed.weight (tied copy)"] = expected["embed.weight"]
    assert_close_dicts(weights, expected, rtol=1e-4, atol=WEIGHT_ATOL, what="weights")


CASES = [  # (world, layout, model and batch)
    (2, ["parallel.pp=2", "parallel.schedule=zb-v"], ["model.tie_embeddings=true", "model.num_layers=4"]),
    (2, ["parallel.pp=2", "parallel.schedule=dualpipe-v"], ["model.num_layers=3", *MOE]),
    (4, ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "parallel.schedule=dualpipe-v"],
     ["model.tie_embeddings=true", "model.num_layers=4", "train.global_batch_size=8"]),
    (4, ["parallel.pp=4", "parallel.schedule=zb-v"],
     ["model.tie_embeddings=true", "model.num_layers=6", "train.global_batch_size=8"]),
    (4, ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.schedule=zb-v"],
     ["model.tie_embeddings=true", "model.num_layers=4", *MOE]),
]


@pytest.mark.parametrize("world,layout,model", CASES, ids=lambda x: x if isinstance(x, int) else "-".join(
    o.split("=")[1] for o in x if o.startswith(("parallel.", "model.tie", "model.num_experts"))))
def test_v_schedules_match_world_size_1(worlds, world, layout, model):
    ref = run(None, model)
    got = worlds.run(world, run, [*layout, *model])
    pp = int(next(o for o in layout if o.startswith("parallel.pp=")).split("=")[1])
    assert got[0]["stages"] == [0, 2 * pp - 1]  # rank 0 holds both ends of the V
    assert_parity(got, ref)


def test_doubled_gradients_fail_assert_parity(monkeypatch):
    """Mutant: every gradient doubled at world size 1 through the real Trainer; assert_parity against the clean
    run fails on the grad norm (clipping at 0.05 hides the scale from the losses and weights)."""
    model = ["model.tie_embeddings=true", "model.num_layers=4"]
    ref = run(None, model)
    double_every_gradient(monkeypatch)
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_parity([run(None, model)], ref)


@pytest.mark.parametrize("world,overrides,match", [
    (1, ["parallel.schedule=zb-v"], r"schedule=zb-v needs parallel.pp >= 2"),
    (2, ["parallel.pp=2", "parallel.schedule=dualpipe-v", "train.global_batch_size=3"],
     r"schedule=dualpipe-v needs at least 2\*pp = 4 microbatches per step .*got 3"),
    (2, ["parallel.pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=3"],
     r"schedule=zb-v places exactly two model chunks on each pipeline rank"),
    (4, ["parallel.pp=2", "parallel.schedule=zb-v", "parallel.zero=3", "train.global_batch_size=8"],
     r"schedule=zb-v: ZeRO-3 .*split"),
    (4, ["parallel.pp=2", "parallel.schedule=dualpipe-v", "parallel.zero=3", "train.global_batch_size=8"],
     r"schedule=dualpipe-v: ZeRO-3"),
    (2, ["parallel.pp=2", "parallel.schedule=zb-v", "model.num_layers=1"],
     r"pipeline split .*2 chunk\(s\) per rank"),
])
def test_v_schedule_requirements_are_one_config_error(world, overrides, match):
    from parallel3d.training.config import ConfigError
    with pytest.raises(ConfigError, match=match):
        make_config(overrides, world)


def test_v_schedule_accepts_virtual_stages_2():
    cfg = make_config(["parallel.pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2"], 2)
    assert cfg.parallel.schedule == "zb-v"


def test_dry_run_on_meta_matches_a_real_v_step(worlds):
    """The fake-device stand-in for CUDA (docs/architecture.md section 2.6) runs the V step on every rank, and its comm_bytes equal
    the real gloo step's: the local tie on rank 0 moves nothing, the embedding group is not used."""
    from test_fake_device import _real_step_bytes
    from parallel3d.mesh import MeshSpec, ParallelContext

    overrides = ["parallel.pp=2", "parallel.dp=2", "parallel.zero=2", "parallel.schedule=zb-v",
                 "model.tie_embeddings=true", "model.num_layers=4", "train.global_batch_size=8"]
    real = worlds.run(4, _real_step_bytes, overrides)
    cfg = make_config(overrides, 4)
    p = cfg.parallel
    for rank in range(4):
        ctx = ParallelContext.simulated(MeshSpec.of(p), rank, "meta")
        simulated = build_trainer(cfg, ctx).train_step()["comm_bytes"]
        assert simulated == real[rank] and simulated, (rank, simulated, real[rank])
        assert not any(k.startswith("embedding.") for k in simulated)


def test_checkpoint_of_a_v_run_resumes_under_other_layouts(worlds, tmp_path):
    """A checkpoint saved under zb-v (tied embedding and head both on pipeline rank 0, dp=2, ZeRO-1) holds every
    tensor exactly once and resumes exactly under the same layout and under 1F1B with tp=2."""
    from ckpt_helpers import train
    from test_checkpoint import _assert_close, _assert_tiled

    model = ["model.tie_embeddings=true", "model.num_layers=4", "train.global_batch_size=8"]
    saved = ["parallel.pp=2", "parallel.dp=2", "parallel.zero=1", "parallel.schedule=zb-v"]
    ref = train(None, model, 4)
    root = str(tmp_path / "ckpt")
    full = worlds.run(4, train, model + saved, 4, root, (2,))[0]
    _assert_close(full, ref, 1e-5, "zb-v run vs world size 1")
    _assert_tiled(f"{root}/step_{2:08d}")
    assert worlds.run(4, train, model + saved, 4, None, (), root)[0] == full[2:]
    got = worlds.run(4, train, model + ["parallel.pp=2", "parallel.tp=2"], 4, None, (), root)[0]
    _assert_close(got, ref[2:], 1e-4, "zb-v checkpoint resumed under 1f1b tp=2 pp=2")


def _runtime_memory_worker(w):
    from parallel3d.models.config import ModelConfig
    from parallel3d.models.llama import Llama
    from parallel3d.mesh import MeshSpec
    from parallel3d.pipeline import partition_layers, placement_of, stage_ids
    from parallel3d.pipeline.runtime import PipelineStats, run_pipeline_step

    torch.set_num_threads(1)
    ctx = w.context(MeshSpec(pp=w.world_size))
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48, num_layers=8)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (8, 1, 17), generator=g)
    mbs = [{"ids": t[:, :-1], "labels": t[:, 1:], "position_ids": torch.arange(16)} for t in tokens]
    out = {}
    for name, v in (("1f1b", 1), ("zb-v", 2), ("dualpipe-v", 2)):
        stages = partition_layers(8, ctx.spec.pp, v)
        chunks = []
        for s in stage_ids(ctx.coords.pp, ctx.spec.pp, v, placement_of(name)):
            chunks.append(Llama(cfg, ctx, layers=stages[s], pre=s == 0, post=s == ctx.spec.pp * v - 1))
            chunks[-1].init_weights(3)
        stats = PipelineStats()
        loss = run_pipeline_step(ctx, chunks, name, mbs, loss_scale=1.0, backward=lambda x: x.backward(),
                                 stats=stats)
        out[name] = (stats.peak_live, float(loss))
    return out


def test_runtime_holds_what_the_v_schedules_promise(worlds):
    """The runtime's live (microbatch, chunk) activations peak where the schedule says (kept until the weight
    pass): ZB-V at 2p half-stage chunks = 1F1B's p stages, DualPipe-V one chunk more; same loss as 1F1B."""
    from parallel3d.pipeline import build_schedule, peak_in_flight

    p = 4
    results = worlds.run(p, _runtime_memory_worker)
    for name in ("zb-v", "dualpipe-v"):
        promised = [peak_in_flight(s, until_weight=True) for s in build_schedule(name, p, 8, 2)]
        assert [r[name][0] for r in results] == promised
    assert results[0]["zb-v"][0] == 2 * results[0]["1f1b"][0] == 2 * p
    assert results[0]["dualpipe-v"][0] == 2 * p + 1
    # the loss sits on the rank of the last stage: rank p-1 for 1F1B, rank 0 for the V
    assert results[0]["zb-v"][1] == pytest.approx(results[-1]["1f1b"][1], rel=1e-6)
    assert results[0]["dualpipe-v"][1] == pytest.approx(results[-1]["1f1b"][1], rel=1e-6)
