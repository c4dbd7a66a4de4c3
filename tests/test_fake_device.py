"""The suite's stand-in for NCCL: the real training step of one rank, on a device that is not the CPU.

`ParallelContext.simulated(spec, rank, device)` gives one rank of any layout whose groups are answered by the
comm layer's simulated backend (shaped outputs, exact byte accounting, no peers). The step runs on the
`meta` device: tensors have shapes and a device but no values, ops that mix it with CPU tensors raise (as
CUDA ones do), and every collective checks that its tensors are on the group's device. So a CPU tensor
reaching a collective, or an op mixing devices, fails here as it would on a GPU cluster.

Why `meta` and not FakeTensorMode's `cuda`: on torch's CPU-only build, Python indexing of a fake CUDA tensor
installs a CUDA device guard and fails ("PyTorch is not linked with support for cuda devices"), so no model
can be traced that way here; `meta` has the same placement rules and runs every op our step uses.
"""
from __future__ import annotations

import pytest
import torch

from ckpt_helpers import build_trainer, make_config
from parallel3d import comm
from parallel3d.comm import CollectiveError
from parallel3d.mesh import MeshSpec, ParallelContext

DENSE = ["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.sp=true", "parallel.zero=3",
         "train.global_batch_size=8", "model.num_layers=4"]
MOE = [*DENSE, "parallel.ep=2", "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32"]
WORLD = 16  # tp2 x cp2 x dp2 x pp2


def _roles(spec: MeshSpec) -> list[int]:
    """One rank per pipeline stage, and ranks whose tp/cp/dp/ep coordinates differ."""
    first_of_stage = [min(r for r in range(spec.world_size) if spec.coords(r).pp == s) for s in range(spec.pp)]
    return sorted(set(first_of_stage) | {spec.world_size - 1})


def _step(overrides: list[str], rank: int) -> tuple[dict, ParallelContext, object]:
    cfg = make_config(overrides, WORLD)
    p = cfg.parallel
    ctx = ParallelContext.simulated(MeshSpec.of(p), rank, "meta")
    trainer = build_trainer(cfg, ctx)
    return trainer.train_step(), ctx, trainer


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_training_step_runs_off_the_cpu(model):
    overrides = DENSE if model == "dense" else MOE
    cfg = make_config(overrides, WORLD)
    spec = MeshSpec(tp=2, cp=2, dp=cfg.parallel.dp, pp=2, ep=cfg.parallel.ep)
    for rank in _roles(spec):
        out, ctx, trainer = _step(overrides, rank)
        assert not out["skipped"]
        for chunk in trainer.chunks:
            assert all(p.device.type == "meta" for p in chunk.parameters())
        ops = set(ctx.stats.summary())
        # every dimension really communicated: TP/SP, ring CP, the pipeline, ZeRO-3 gathers and reductions
        assert {("tp", "all_gather"), ("tp", "reduce_scatter"), ("cp", "send"), ("dp_cp", "all_gather"),
                ("dp_cp", "reduce_scatter"), ("world", "all_reduce")} <= ops, ops
        assert ("pp", "send") in ops or ("pp", "recv") in ops
        if model == "moe":
            assert ("ep", "all_to_all") in ops


@pytest.mark.parametrize("fold", [["parallel.ep=8"], ["parallel.ep=4", "parallel.etp=2"]], ids=["etp1-ep8", "etp2-ep4"])
def test_folded_moe_layouts_run_off_the_cpu(fold):
    """MoE parallel folding on the stand-in device: EP over all 8 TP x CP x DP ranks of a stage with whole
    experts, and etp=2 (= tp: the layout before folding) with EP over CP x DP."""
    overrides = [*MOE, "model.num_experts=8", *fold]
    for rank in (WORLD - 1,):   # the last stage: MoE layers, the head and the loss
        out, ctx, trainer = _step(overrides, rank)
        assert not out["skipped"]
        spec = ctx.spec
        assert ctx.ep.size * ctx.etp.size * ctx.edp.size == spec.tp * spec.cp * spec.dp
        assert {spec.coords(r).pp for r in ctx.ep.ranks} == {ctx.coords.pp}
        assert len({spec.coords(r).tp for r in ctx.ep.ranks}) == (2 if ctx.etp.size == 1 else 1)
        assert ("ep", "all_to_all") in ctx.stats.summary()
        experts = [p for chunk in trainer.chunks for n, p in chunk.named_parameters() if ".experts.gate_proj" in n]
        assert experts and all(p.shape[0] == 8 // ctx.ep.size and p.shape[1] == 32 // ctx.etp.size for p in experts)


def test_evaluation_runs_off_the_cpu():
    _, ctx, trainer = _step(DENSE, 0)
    from parallel3d.training.trainer import make_dataset
    loss, tokens = trainer.evaluate(make_dataset(trainer.cfg, None), 1)
    assert tokens == 8 * 32  # global batch x seq_len: the count is reduced on the device


def test_cpu_tensor_in_a_collective_is_caught():
    ctx = ParallelContext.simulated(MeshSpec(dp=2), 0, "meta")
    with pytest.raises(CollectiveError, match=r"all_reduce on dp group .* is on cpu, the group's device is meta"):
        comm.all_reduce(torch.ones(3), ctx.dp)
    with pytest.raises(CollectiveError, match="all_gather"):
        comm.start_all_gather(torch.empty(4, device="meta"), torch.ones(2), ctx.dp)
    comm.all_reduce(torch.ones(3, device="meta"), ctx.dp)  # the right device passes


def test_simulated_outputs_have_the_real_shapes_and_bytes():
    ctx = ParallelContext.simulated(MeshSpec(tp=4), 1, "cpu")
    x = torch.arange(6.0).view(2, 3)
    gathered = comm.all_gather(x, ctx.tp, dim=1)
    assert gathered.shape == (2, 12) and torch.equal(gathered[:, 3:6], x)
    part = comm.reduce_scatter(torch.arange(8.0), ctx.tp)
    assert torch.equal(part, torch.tensor([2.0, 3.0]))  # this rank's block
    out = comm.all_to_all(torch.ones(4, 2), ctx.tp, out_splits=[1, 2, 3, 1], in_splits=[1, 1, 1, 1])
    assert out.shape == (7, 2)
    assert ctx.stats.summary() == {("tp", "all_gather"): (1, 96), ("tp", "reduce_scatter"): (1, 32),
                                   ("tp", "all_to_all"): (1, 32)}


@pytest.mark.multigpu
def test_two_gpu_pretrain_smoke(tmp_path):
    """On a machine with 2 GPUs: the CLI over NCCL, tp=1 dp=2 ZeRO-1, and pp=2."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for layout in (["parallel.zero=1"], ["parallel.pp=2", "parallel.tp=1"]):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               "launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", "train.steps=3",
               "model.kernels=auto", *layout]
        proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]


def _real_step_bytes(w, overrides: list[str]) -> dict:
    torch.set_num_threads(1)
    cfg = make_config(overrides, w.world_size)
    p = cfg.parallel
    trainer = build_trainer(cfg, w.context(MeshSpec.of(p)))
    return trainer.train_step()["comm_bytes"]


@pytest.mark.parametrize("layout", [
    ["parallel.tp=2", "parallel.pp=2", "parallel.sp=true", "parallel.zero=1"],
    ["parallel.cp=2", "parallel.zero=3", "parallel.tp=1"],
    ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2", "parallel.zero=2",
     "parallel.tp=1", "model.tie_embeddings=true"],
], ids=["tp-pp-sp-zero1", "cp-dp-zero3", "interleaved-tied-zero2"])
def test_dry_run_bytes_equal_a_real_run(worlds, layout):
    """comm_bytes (the JSONL field) of the simulated step equal what the real gloo step records, per rank."""
    overrides = [*layout, "model.num_layers=4", "train.global_batch_size=8"]
    real = worlds.run(4, _real_step_bytes, overrides)
    cfg = make_config(overrides, 4)
    p = cfg.parallel
    for rank in range(4):
        ctx = ParallelContext.simulated(MeshSpec.of(p), rank, "meta")
        simulated = build_trainer(cfg, ctx).train_step()["comm_bytes"]
        assert simulated == real[rank], (rank, simulated, real[rank])
        assert simulated  # something was communicated
