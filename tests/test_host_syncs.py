"""Host syncs per training step (parallel3d/host_sync.py): counted by the meta dry run and by CPU runs alike,
reported in the step record, the JSONL row and the plan JSON, and bounded.

The bound: everything but the MoE split sizes is a handful of reads per step (the global target-token count,
the loss-scale probe on a stage that sends an auxiliary objective, the gradient norm with the non-finite flag,
the loss; the MoE telemetry once per stage at log time), the same for 2 or 4 layers and 1 or 4 microbatches.
The split sizes of drop-less expert dispatch ("moe_splits") are read once per MoE layer forward, so exactly
MoE layers x microbatches (full recomputation replays the forward's split sizes: no second read).
"""
from __future__ import annotations

import json

import pytest
import torch

from launch.common import stage_builder
from parallel3d import host_sync
from parallel3d.host_sync import HostSyncs, blocking_upload, read_float, read_list, read_tensor, upload
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.models.config import ModelConfig
from parallel3d.planner.dryrun import tracked_step
from parallel3d.training.config import load_config
from parallel3d.training.trainer import Trainer
from parallel3d.training.validate import resolve_and_validate

SMALL = ["model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_hidden_size=64",
         "model.vocab_size=64", "model.kernels=torch", "model.max_seq_len=64", "train.seq_len=16",
         "train.micro_batch_size=1", "train.precision=fp32", "train.steps=1", "log.interval=1",
         "checkpoint.keep=0", "train.eval_interval=0", "parallel.tp=1"]
MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32", "model.aux_loss_coef=0.01",
       "model.z_loss_coef=0.001"]
# configs/deepseek_v3.yaml shrunk: MLA, 8 routed experts in 4 groups (2 kept), a shared expert, the first
# layer dense, sigmoid scores with bias balancing, the sequence-wise loss and one MTP module (an MoE layer)
DEEPSEEK_V3 = ["model.vocab_size=64", "model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=4",
               "model.ffn_hidden_size=64", "model.q_lora_rank=16", "model.kv_lora_rank=8",
               "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6",
               "model.num_experts=8", "model.moe_top_k=2", "model.moe_ffn_hidden_size=16",
               "model.router_num_groups=4", "model.router_topk_groups=2", "model.first_k_dense=1",
               "model.max_seq_len=64", "model.kernels=torch", "train.seq_len=16", "train.precision=fp32",
               "train.steps=1", "train.eval_interval=0", "parallel.layers_per_stage=null", "parallel.zero=1",
               "parallel.schedule=1f1b"]

# id: (config file, model overrides, layout overrides, world); each runs tp x pp x dp (x ep) with recomputation
LAYOUTS = {
    "dense-tp2-pp2-dp2-full": ("configs/tiny.yaml", SMALL, ["parallel.tp=2", "parallel.pp=2", "parallel.zero=1",
                                                           "train.activation_checkpointing=full"], 8),
    "mixtral-softmax-tp2-pp2-dp2-ep2-sp-selective": (
        "configs/tiny.yaml", [*SMALL, *MOE], ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.ep=2",
                                              "parallel.zero=1", "train.activation_checkpointing=selective"], 8),
    "qwen3-softmax-unnormalised-pp2-dp2-ep2-zero3-full": (
        "configs/tiny.yaml", [*SMALL, *MOE, "model.router_norm_topk=false", "model.qk_norm=true"],
        ["parallel.pp=2", "parallel.ep=2", "parallel.zero=3", "train.activation_checkpointing=full"], 4),
    "sigmoid-bias-capacity-tp2-pp2-dp2-ep2-full": (
        "configs/tiny.yaml", [*SMALL, *MOE, "model.router_score=sigmoid", "model.router_bias_update_rate=0.01",
                              "model.capacity_factor=1.0"],
        ["parallel.tp=2", "parallel.pp=2", "parallel.ep=2", "train.activation_checkpointing=full"], 8),
    "grouped-local-cp2-pp2-dp2-ep2": (
        "configs/tiny.yaml", [*SMALL, *MOE, "model.router_num_groups=2", "model.router_topk_groups=1",
                              "model.moe_aux_scope=local"],
        ["parallel.cp=2", "parallel.pp=2", "parallel.ep=2"], 8),
    "deepseek-v3-tp2-pp2-dp2-ep2-full": (
        "configs/deepseek_v3.yaml", DEEPSEEK_V3,
        ["parallel.tp=2", "parallel.pp=2", "parallel.ep=2", "train.activation_checkpointing=full"], 8),
}
HANDFUL = 5  # token count, loss-scale probe, grad norm + non-finite flag, loss, MoE telemetry


def _config(path: str, model: list, layout: list, world: int, layers: int, microbatches: int):
    dims = {k: int(v) for k, v in (o[len("parallel."):].split("=") for o in layout if o[len("parallel."):] in
                                   [f"{d}={n}" for d in ("tp", "pp", "cp") for n in (1, 2, 4)])}
    dp = world // (dims.get("tp", 1) * dims.get("pp", 1) * dims.get("cp", 1))
    batch = [f"model.num_layers={layers}", f"train.global_batch_size={microbatches * dp}"]
    return resolve_and_validate(load_config(path, [*model, *layout, *batch], ModelConfig), world)


def _spec(cfg) -> MeshSpec:
    p = cfg.parallel
    return MeshSpec.of(p)


def _moe_layers(trainer: Trainer) -> tuple[int, int]:
    """(this rank's MoE layers of the trunk, of the MTP modules)."""
    ids = [i for c in trainer.chunks if hasattr(c, "moe_layers") for i in c.moe_layers()]
    mtp = sum(i >= trainer.cfg.model.num_layers for i in ids)
    return len(ids) - mtp, mtp


def _step_syncs(trainer: Trainer, device: str) -> dict:
    """One tracked step and the MoE telemetry, as the training loop logs them: the JSONL row's host_syncs."""
    out, _ = tracked_step(trainer, device)
    for chunk in trainer.chunks:
        if hasattr(chunk, "moe_load_stats"):
            chunk.moe_load_stats()
    assert out["host_syncs"]["total"] <= trainer.ctx.stats.syncs.summary()["total"]
    return trainer.ctx.stats.syncs.summary()


def dry_run(cfg, rank: int) -> tuple[dict, int]:
    """(host syncs of `rank`'s step on the meta stand-in, its MoE layers (trunk, MTP))."""
    ctx = ParallelContext.simulated(_spec(cfg), rank, "meta")
    trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx))
    return _step_syncs(trainer, "meta"), _moe_layers(trainer)


def _fixed(syncs: dict) -> dict:
    return {k: v for k, v in syncs.items() if k not in host_sync.PER_LAYER and k != "total"}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_host_syncs_do_not_grow_with_layers_or_microbatches(name):
    path, model, layout, world = LAYOUTS[name]
    few, many = (3, 5) if path.endswith("deepseek_v3.yaml") else (2, 4)  # the first (dense) layer stays apart
    for rank in (0, world - 1):  # the first and the last pipeline stage
        seen = {}
        for layers, microbatches in ((few, 1), (many, 4)):
            cfg = _config(path, model, layout, world, layers, microbatches)
            syncs, (trunk, mtp) = dry_run(cfg, rank)
            assert "upload" not in syncs, syncs  # no blocking host-to-device copy
            expected = (trunk + mtp) * microbatches  # one read per MoE layer forward, none in recomputation
            assert syncs.get("moe_splits", 0) == expected, (layers, microbatches, syncs)
            assert sum(_fixed(syncs).values()) <= HANDFUL, syncs
            seen[(layers, microbatches)] = _fixed(syncs)
        assert seen[(few, 1)] == seen[(many, 4)], seen
        if "num_experts" in " ".join(model):
            assert seen[(few, 1)].get("logging") == 1  # the stage's MoE telemetry: one read for all its layers


def test_a_cpu_step_counts_what_the_dry_run_counts():
    """World size 1 on the CPU (real values) and on the meta stand-in (nominal values): the same syncs."""
    for model in (SMALL, [*SMALL, *MOE, "model.capacity_factor=1.0"]):
        cfg = _config("configs/tiny.yaml", model, ["train.activation_checkpointing=full"], 1, 2, 2)
        counts = []
        for device in ("cpu", "meta"):
            ctx = ParallelContext.simulated(MeshSpec(), 0, device)
            counts.append(_step_syncs(Trainer(cfg, ctx, stage_builder(cfg, ctx)), device))
        assert counts[0] == counts[1], counts


def _gloo_step(w, model, layout):
    cfg = _config("configs/tiny.yaml", model, layout, w.world_size, 2, 2)
    ctx = w.context(_spec(cfg))
    return _step_syncs(Trainer(cfg, ctx, stage_builder(cfg, ctx)), "cpu")


def test_gloo_ranks_count_what_their_dry_runs_count(worlds):
    model, layout = [*SMALL, *MOE], ["parallel.pp=2", "parallel.ep=2", "train.activation_checkpointing=full"]
    real = worlds.run(4, _gloo_step, model, layout)
    for rank, syncs in enumerate(real):
        assert syncs == dry_run(_config("configs/tiny.yaml", model, layout, 4, 2, 2), rank)[0], rank


def test_moe_layer_reads_its_splits_once_and_keeps_statistics_on_the_device():
    """One MoE layer forward: one read (the split sizes, sent and received together); its load and aux values
    stay device tensors until the telemetry reads them."""
    from parallel3d.models.moe import MoETransformer

    cfg = load_config("configs/tiny.yaml", [*SMALL, *MOE, "model.capacity_factor=1.0", "model.num_layers=1"],
                      ModelConfig).model
    ctx = ParallelContext.single()
    model = MoETransformer(cfg, ctx)
    model.init_weights(0)
    model(torch.randint(0, 64, (2, 16)), torch.arange(16), torch.randint(0, 64, (2, 16))).backward()
    assert ctx.stats.syncs.summary() == {"moe_splits": 1, "total": 1}
    layer = model.moe_layers()[0]
    assert isinstance(layer._load, torch.Tensor) and all(isinstance(v, torch.Tensor) for v in layer.last_aux.values())
    stats = model.moe_load_stats()
    assert ctx.stats.syncs.summary() == {"logging": 1, "moe_splits": 1, "total": 2}
    assert sum(stats["moe_tokens_per_expert.0"]) == 2 * 16 * 2 and stats["moe_aux_loss.0"] > 0


def test_jsonl_rows_and_plan_json_report_host_syncs(tmp_path):
    from parallel3d.planner.estimate import plan
    from parallel3d.planner.hardware import gpu
    from parallel3d.training.loop import run_training

    log = tmp_path / "log.jsonl"
    cfg = _config("configs/tiny.yaml", [*SMALL, *MOE, f"log.jsonl={log}", "train.steps=2"], [], 1, 2, 2)
    ctx = ParallelContext.single()
    run_training(cfg, ctx, stage_builder(cfg, ctx))
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["host_syncs"] for r in rows] == [{"step": 3, "logging": 1, "moe_splits": 4, "total": 8}] * 2

    # 8 microbatches of which the dry run runs fewer: the split reads scale to the full step, the rest do not
    cfg = _config("configs/tiny.yaml", [*SMALL, *MOE], ["parallel.pp=2", "parallel.ep=2"], 4, 4, 8)
    result = plan(cfg, stage_builder, gpu("h100"), 8).to_json()
    assert result["host_syncs"]["moe_splits"] == 2 * 8  # 2 MoE layers per stage, 8 microbatches
    assert result["host_syncs"]["logging"] == 1 and result["host_syncs"]["step"] <= 4  # as the JSONL rows
    assert result["host_syncs"]["total"] == sum(v for k, v in result["host_syncs"].items() if k != "total")


def test_reads_are_counted_and_nominal_on_the_stand_in():
    syncs = HostSyncs()
    assert read_float(torch.tensor(2.5), syncs, "step") == 2.5
    assert read_list(torch.tensor([1, 2]), syncs, "moe_splits", [0, 0]) == [1, 2]
    assert read_float(torch.ones((), device="meta"), syncs, "step", nominal=7.0) == 7.0
    assert read_list(torch.ones(2, device="meta"), syncs, "moe_splits", [3, 4]) == [3, 4]
    assert torch.equal(read_tensor(torch.ones(2, device="meta"), syncs, "logging"), torch.zeros(2))
    assert syncs.summary() == {"step": 2, "logging": 1, "moe_splits": 2, "total": 5}
    with pytest.raises(ValueError, match="unknown host-sync category 'later'"):
        syncs.add("later")


def test_the_tracker_sees_blocking_uploads_onto_the_stand_in():
    from parallel3d.planner.tracker import StepTracker

    syncs = HostSyncs()
    host = torch.arange(4)
    with StepTracker(device_type="meta", syncs=syncs):
        upload(host, torch.device("meta"))                    # what CUDA gets pinned and non-blocking
        torch.empty(4, dtype=torch.int64, device="meta").copy_(host, non_blocking=True)
        assert syncs.summary() == {"total": 0}
        host.to("meta")                                       # pageable and blocking: a sync on CUDA
        torch.empty(4, dtype=torch.int64, device="meta").copy_(host)
    assert syncs.summary() == {"upload": 2, "total": 2}
    assert not blocking_upload(torch.ops.aten._to_copy.default, (host,), {"device": torch.device("cpu")}, "cpu")


# ---- model.moe_aux_scope ------------------------------------------------------------------------------------
AUX = dict(aux_loss_coef=0.1, z_loss_coef=0.01, seq_aux_loss_coef=0.1, score="sigmoid")


def _aux_term(ctx: ParallelContext, scope: str, x: torch.Tensor) -> tuple[float, dict]:
    """One MoE layer forward (weights seeded by name: the same global weights on any layout): its auxiliary
    term and the collectives the forward ran."""
    from parallel3d.expert_parallel import MoELayer
    from parallel3d.params import init_parameters

    layer = MoELayer(16, 24, 4, 2, ctx, aux_scope=scope, **AUX)
    init_parameters(layer, 0, 0.3)
    ctx.stats.reset()
    layer(x)
    return layer.pop_aux_loss().item(), ctx.stats.summary()


def _scopes(w):
    ctx = w.context(MeshSpec(dp=2, ep=2))
    xs = [torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    out = {scope: _aux_term(ctx, scope, xs[w.rank]) for scope in ("global", "local")}
    out["alone"] = _aux_term(ParallelContext.single(), "global", xs[w.rank])[0]   # this rank's tokens
    out["whole"] = _aux_term(ParallelContext.single(), "global", torch.cat(xs))[0]  # the global micro-batch
    return out


def test_local_aux_scope_runs_no_collective_in_forward_and_global_keeps_the_global_statistics(worlds):
    results = worlds.run(2, _scopes)
    for r in results:
        (local, local_ops), (glob, glob_ops) = r["local"], r["global"]
        assert set(local_ops) == {("ep", "all_to_all")}, local_ops  # the dispatch only: no statistics reduced
        assert ("dp_cp", "all_reduce") in glob_ops, glob_ops
        assert local == pytest.approx(r["alone"], rel=1e-6)  # the loss of this rank's own tokens
    # global (the default, today's behaviour): the ranks' terms sum to the world-size-1 term of the batch
    assert sum(r["global"][0] for r in results) == pytest.approx(results[0]["whole"], rel=1e-5)
    assert results[0]["local"][0] != pytest.approx(results[0]["global"][0], rel=1e-3)  # the scopes differ


def test_bad_aux_scope_is_one_clear_error():
    from parallel3d.training.config import ConfigError

    with pytest.raises(ConfigError, match=r"model.moe_aux_scope must be one of global, local, got 'dp'"):
        _config("configs/tiny.yaml", [*SMALL, *MOE, "model.moe_aux_scope=dp"], [], 1, 2, 1)
