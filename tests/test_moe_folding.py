"""MoE parallel folding (parallel.etp; mesh_spec.py) through the real Trainer and DistributedOptimizer: expert
parallelism folded over TP x CP x DP, whole (etp=1) or etp-split experts, for the Mixtral, Qwen3-MoE and
DeepSeek-V3 families. Each layout trains 3 AdamW steps on 4 gloo ranks and matches the world-size-1 run of the
same config: loss rel 1e-5, every rank's logged grad_norm rel 1e-4 per step, the fp32 master weights rtol 1e-4 /
atol tests/parity.WEIGHT_ATOL (expert weights included, assembled from every rank's global slices).
Checkpoints resharded between (tp, etp, ep) layouts: tests/test_checkpoint.py; the layer alone at more folds,
with recomputation and capacity: tests/test_moe_parity.py; bad layouts: tests/test_config.py."""
from __future__ import annotations

import pytest

from parity import WEIGHT_ATOL, assemble, assert_close_dicts, assert_grad_norms
from test_deepseek_parity import DEEPSEEK
from test_qwen3_parity import QWEN3_MOE
from test_sweep import run

BATCH = ["train.global_batch_size=4", "train.micro_batch_size=1"]
# Balancing losses off where they are batch statistics (their micro-batch grouping differs between dp=1 and
# dp>1: docs/architecture.md 2.2); the z-loss and DeepSeek-V3's sequence-wise loss are layout-free and stay on.
MIXTRAL = ["model.num_experts=4", "model.moe_top_k=2", "model.aux_loss_coef=0", "model.z_loss_coef=0.001",
           "model.init_std=0.1"]
FAMILIES = {"mixtral": MIXTRAL, "qwen3-moe": QWEN3_MOE, "deepseek-v3": [*DEEPSEEK, "model.num_layers=2"]}

SP = ["parallel.tp=2", "parallel.sp=true"]
LAYOUTS = {  # id: overrides on 4 ranks, and which fold it exercises
    "tp2-sp-etp1-ep4": [*SP, "parallel.ep=4"],                          # EP over TP x DP, whole experts
    "tp2-sp-etp2-ep2": [*SP, "parallel.ep=2", "parallel.etp=2"],        # experts split like the MLP (before)
    "tp2-cp2-sp-etp1-ep4": [*SP, "parallel.cp=2", "parallel.ep=4"],     # EP over TP x CP
    "pp2-tp2-sp-etp1-ep2": [*SP, "parallel.pp=2", "parallel.ep=2"],     # EP over a stage's TP ranks
    "tp2-etp1-ep2-zero3": ["parallel.tp=2", "parallel.ep=2", "parallel.zero=3"],  # no SP: split_forward,
    "tp1-dp4-etp2-ep2-zero1": ["parallel.ep=2", "parallel.etp=2", "parallel.zero=1"],  # etp over DP ranks
    "tp2-sp-etp1-ep2-hsdp": [*SP, "parallel.ep=2", "parallel.zero=2", "parallel.dp_shard=1"],  # expert HSDP
}
# CI: every family, one fold each; make sweep: the whole product (etp=2 in CI: test_moe_parity's dp4-etp2-ep2
# and tp4-etp2-ep2 at the layer, test_checkpoint's resume at tp2 etp2 ep2 through the Trainer)
CI = {("qwen3-moe", "tp2-sp-etp1-ep4"), ("deepseek-v3", "tp2-cp2-sp-etp1-ep4"), ("mixtral", "pp2-tp2-sp-etp1-ep2")}
CASES = [pytest.param(f, lay, id=f"{f}-{lay}", marks=() if (f, lay) in CI else pytest.mark.sweep)
         for f in FAMILIES for lay in LAYOUTS]
_REFERENCE: dict[str, dict] = {}


def _reference(family: str) -> dict:
    if family not in _REFERENCE:
        _REFERENCE[family] = run(None, [*BATCH, *FAMILIES[family]])
    return _REFERENCE[family]


@pytest.mark.parametrize("family, layout", CASES)
def test_folded_layout_matches_world_size_1(worlds, family, layout):
    ref = _reference(family)
    got = worlds.run(4, run, [*BATCH, *FAMILIES[family], *LAYOUTS[layout]])
    what = f"{family} {layout}"
    assert got[0]["losses"] == pytest.approx(ref["losses"], rel=1e-5), (what, got[0]["losses"], ref["losses"])
    assert_grad_norms([g["norms"] for g in got], ref["norms"], what=what)
    weights, expected = assemble([g["weights"] for g in got]), assemble([ref["weights"]])
    experts = [n for n in expected if ".mlp.experts." in n]
    assert experts and set(experts) <= set(weights), what   # every expert weight came back from some rank
    assert_close_dicts(weights, expected, rtol=1e-4, atol=WEIGHT_ATOL, what=f"{what} weights")
    initial = run_initial(family)
    assert any((expected[n] - initial[n]).abs().max() > 1e-3 for n in experts), f"{what}: experts did not train"


_INITIAL: dict[str, dict] = {}


def run_initial(family: str) -> dict:
    """The world-size-1 weights before any step (so the check that the experts trained can fail)."""
    if family not in _INITIAL:
        from ckpt_helpers import build_trainer, context_for, make_config
        from parity import local_slices

        cfg = make_config([*BATCH, *FAMILIES[family]], 1)
        trainer = build_trainer(cfg, context_for(cfg))
        _INITIAL[family] = assemble([{n: v for chunk in trainer.chunks for n, v in local_slices(chunk, "data").items()}])
    return _INITIAL[family]
