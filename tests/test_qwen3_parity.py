"""Qwen3 features under every parallel layout, through the real Trainer and DistributedOptimizer.

QK-norm (per local head under TP, its weight gradient summed over TP), q/k/v biases (split with their heads, or
replicated with a partial gradient when tp > kv heads), head_dim decoupled from hidden/heads, and the
Qwen3-MoE routing (softmax top-k without renormalisation, many small experts, a dense first layer).
Each layout trains 3 AdamW steps on 4 gloo ranks and is compared with the world-size-1 run of the same config
(loss rel 1e-5 and every rank's grad_norm rel 1e-4 per step, fp32 master weights rtol 1e-4 / atol tests/parity.WEIGHT_ATOL). The meta-device dry
run checks the same model off the CPU (placement rules of CUDA/NCCL).
"""
from __future__ import annotations

import pytest
import torch

from ckpt_helpers import build_trainer, make_config
from parallel3d.mesh import MeshSpec, ParallelContext
from parity import WEIGHT_ATOL, assemble, assert_close_dicts, assert_grad_norms
from test_sweep import run as sweep_run

BATCH = ["train.global_batch_size=4", "train.micro_batch_size=1"]  # with test_sweep's PARITY keys
QWEN3 = ["model.qk_norm=true", "model.qkv_bias=true", "model.head_dim=16"]  # 4 heads x 16 = 64 != hidden 32
# Qwen3-MoE: 8 small experts, top-2 without renormalising the k weights, the first layer dense. No balancing
# losses: they are batch statistics whose micro-batch grouping differs between dp=1 and dp=2 (test_sweep).
QWEN3_MOE = [*QWEN3, "model.num_experts=8", "model.moe_top_k=2", "model.moe_ffn_hidden_size=16",
             "model.router_norm_topk=false", "model.first_k_dense=1", "model.aux_loss_coef=0", "model.z_loss_coef=0"]


LAYOUTS = {  # name: (model, layout overrides), all on 4 ranks
    "tp4-sp-replicated-kv": (QWEN3, ["parallel.tp=4", "parallel.sp=true"]),
    "tp2-cp2-ring-tied": ([*QWEN3, "model.tie_embeddings=true"], ["parallel.tp=2", "parallel.cp=2"]),
    "pp2-cp2-allgather": (QWEN3, ["parallel.pp=2", "parallel.cp=2", "parallel.cp_mode=allgather"]),
    "cp2-ulysses-dp2-zero1": (QWEN3, ["parallel.cp=2", "parallel.cp_mode=ulysses", "parallel.zero=1"]),
    "tp2-dp2-zero3": (QWEN3, ["parallel.tp=2", "parallel.zero=3"]),
    "moe-ep2-tp2-sp": (QWEN3_MOE, ["parallel.tp=2", "parallel.sp=true", "parallel.ep=2"]),
    "moe-ep4-zero1": (QWEN3_MOE, ["parallel.ep=4", "parallel.zero=1"]),
}


def run(worker, overrides: list[str]) -> dict:
    """test_sweep.run (losses, grad norms and fp32 master weights after its steps) at this file's batch."""
    return sweep_run(worker, [*BATCH, *overrides])


_REFERENCE: dict[tuple, dict] = {}


def reference(model: list[str]) -> dict:
    if tuple(model) not in _REFERENCE:
        _REFERENCE[tuple(model)] = run(None, model)
    return _REFERENCE[tuple(model)]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_world_size_1(worlds, name):
    model, layout = LAYOUTS[name]
    ref = reference(model)
    got = worlds.run(4, run, [*model, *layout])
    assert got[0]["losses"] == pytest.approx(ref["losses"], rel=1e-5), (got[0]["losses"], ref["losses"])
    assert_grad_norms([g["norms"] for g in got], ref["norms"], what=name)
    weights, expected = assemble([g["weights"] for g in got]), assemble([ref["weights"]])
    assert any(".attn.q_norm." in n for n in weights) and any(".attn.k_proj.bias" in n for n in weights)
    assert_close_dicts(weights, expected, rtol=1e-4, atol=WEIGHT_ATOL, what=f"{name} weights")
    # the QK-norm weights really trained (else their parity would say nothing)
    assert (expected["layers.1.attn.q_norm.weight"] - 1).abs().max() > 1e-3


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_training_step_runs_off_the_cpu(model):
    """One rank of each pipeline stage of tp2 x cp2 x dp2 x pp2 (+ ep2) on the meta device."""
    overrides = [*(QWEN3 if model == "dense" else QWEN3_MOE), "parallel.tp=2", "parallel.cp=2", "parallel.pp=2",
                 "parallel.sp=true", "parallel.zero=3", "train.global_batch_size=8", "model.num_layers=4",
                 *(["parallel.ep=2"] if model == "moe" else [])]
    cfg = make_config(overrides, 16)
    p = cfg.parallel
    spec = MeshSpec.of(p)
    for rank in (0, spec.world_size - 1):
        trainer = build_trainer(cfg, ParallelContext.simulated(spec, rank, "meta"))
        assert not trainer.train_step()["skipped"]
        assert all(q.device.type == "meta" for chunk in trainer.chunks for q in chunk.parameters())


def test_triton_kernels_on_the_qk_norm_path_match_torch():
    """The QK-norm runs the RMSNorm kernel on (b, s, heads, head_dim) views: forced Triton (interpreter on CPU)
    gives the torch path's loss and gradients."""
    from parallel3d.models.config import ModelConfig
    from parallel3d.models.llama import Llama

    def loss_and_grads(kernels: str):
        cfg = ModelConfig(vocab_size=48, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=24,
                          ffn_hidden_size=40, qk_norm=True, qkv_bias=True, kernels=kernels)
        model = Llama(cfg, ParallelContext.single())
        model.init_weights(3)
        for name, p in model.named_parameters():  # non-trivial norm weights and biases
            if "norm" in name or name.endswith("bias"):
                p.data.normal_(1.0 if "norm" in name else 0.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
        tokens = torch.randint(0, 48, (2, 13), generator=torch.Generator().manual_seed(1))
        loss = model(tokens[:, :-1], torch.arange(12), tokens[:, 1:]) / 24
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}

    ref_loss, ref_grads = loss_and_grads("torch")
    loss, grads = loss_and_grads("triton")
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
    assert ref_grads["layers.0.attn.q_norm.weight"].abs().max() > 1e-4
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
