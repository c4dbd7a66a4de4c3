"""DeepSeek-V3 (MLA + group-limited sigmoid MoE + shared experts + first-k dense + sequence-wise aux loss +
bias balancing) through the real Trainer and DistributedOptimizer: every layout gives the world-size-1 losses
(rel 1e-5, aux terms included) and weights after the AdamW steps (rtol 1e-4), bias buffers included."""
import pytest
import torch

from ckpt_helpers import build_trainer, context_for, make_config
from parity import assemble, local_slices
from test_trainer_regressions import PARITY, assert_parity

# v_head_dim != qk head dim (8 + 4): v is padded inside the CP kernels; 2 of 4 expert groups kept
DEEPSEEK = ["model.attention_type=mla", "model.num_kv_heads=4", "model.q_lora_rank=16", "model.kv_lora_rank=8",
            "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=4", "model.v_head_dim=6", "model.num_experts=8",
            "model.moe_top_k=2", "model.moe_ffn_hidden_size=16", "model.num_shared_experts=1",
            "model.first_k_dense=1", "model.router_score=sigmoid", "model.router_num_groups=4",
            "model.router_topk_groups=2", "model.routed_scaling_factor=2.0", "model.seq_aux_loss_coef=0.1",
            "model.router_bias_update_rate=0.01", "model.init_std=0.1",
            "model.num_layers=3"]  # pp=2: stage 0 holds the dense layer and an MoE layer, whose aux term crosses
STEPS = 2

LAYOUTS = {  # id: (world, overrides)
    "tp2": (2, ["parallel.tp=2"]),
    "tp2-sp-selective": (2, ["parallel.tp=2", "parallel.sp=true", "train.activation_checkpointing=selective"]),
    "cp2-ring": (2, ["parallel.cp=2", "parallel.cp_mode=ring"]),
    "cp2-allgather": (2, ["parallel.cp=2", "parallel.cp_mode=allgather"]),
    "cp2-ulysses": (2, ["parallel.cp=2", "parallel.cp_mode=ulysses"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2-zero1-ep2": (2, ["parallel.zero=1", "parallel.ep=2"]),
    "dp2-zero3-selective": (2, ["parallel.zero=3", "train.activation_checkpointing=selective"]),
    "tp2-sp-cp2-ep2": (4, ["parallel.tp=2", "parallel.sp=true", "parallel.cp=2", "parallel.ep=2"]),
    "pp2-dp2-zero1-ep2-full": (4, ["parallel.pp=2", "parallel.zero=1", "parallel.ep=2",
                                   "train.activation_checkpointing=full"]),
}
MTP_LAYOUTS = {  # multi-token prediction (depth 2): shifted tokens across CP ranks, the embedding copy on the
    "tp2-sp": (2, ["parallel.tp=2", "parallel.sp=true"]),            # last stage, the MTP MoE layers' aux terms
    "cp2-ring": (2, ["parallel.cp=2"]),
    "pp2": (2, ["parallel.pp=2"]),
    "dp2-zero3-ep2": (2, ["parallel.zero=3", "parallel.ep=2"]),
}
MTP = ["model.mtp_depth=2", "model.mtp_loss_coef=0.5"]
_REF = {}


def run(worker, overrides, steps: int) -> dict:
    """test_trainer_regressions.run, but weights come from the optimizer's fp32 master shards (ZeRO-3 frees
    parameter storage between steps, so the parameters cannot be read there)."""
    torch.set_num_threads(1)
    cfg = make_config([*PARITY, *overrides], 1 if worker is None else worker.world_size)
    trainer = build_trainer(cfg, context_for(cfg, worker))
    records = [trainer.train_step() for _ in range(steps)]
    if cfg.parallel.zero == 3:
        weights = {k[len("master/"):]: (t.clone(), slices, shape)
                   for k, (t, shape, slices) in trainer.optimizer.state_tensors().items() if k.startswith("master/")}
    else:
        weights = {}
        for chunk in trainer.chunks:
            weights.update(local_slices(chunk, "data"))
    return {"records": records, "weights": weights}


def _reference() -> dict:
    if "ref" not in _REF:
        _REF["ref"] = run(None, DEEPSEEK, STEPS)
    return _REF["ref"]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_deepseek_layout_parity(worlds, layout):
    world, overrides = LAYOUTS[layout]
    ref = _reference()
    got = worlds.run(world, run, [*DEEPSEEK, *overrides], STEPS)
    assert_parity(got, ref)


@pytest.mark.parametrize("layout", list(MTP_LAYOUTS))
def test_multi_token_prediction_layout_parity(worlds, layout):
    world, overrides = MTP_LAYOUTS[layout]
    if "mtp" not in _REF:
        _REF["mtp"] = run(None, [*DEEPSEEK, *MTP], STEPS)
    got = worlds.run(world, run, [*DEEPSEEK, *MTP, *overrides], STEPS)
    ref = {**_REF["mtp"], "weights": dict(_REF["mtp"]["weights"])}
    for rank in got:  # the last stage's copy of the embedding (pp > 1) must equal the first stage's
        if "mtp_embed.weight" in rank["weights"]:
            rank["weights"]["embed.weight (mtp copy)"] = rank["weights"].pop("mtp_embed.weight")
            ref["weights"]["embed.weight (mtp copy)"] = ref["weights"]["embed.weight"]
    assert_parity(got, ref)


def test_reference_exercises_every_feature():
    """The layout tests compare against this run: MLA, the sequence-wise aux loss and the routing must act."""
    ref = _reference()
    first = ref["records"][0]["loss"]
    no_seq = run(None, [*DEEPSEEK, "model.seq_aux_loss_coef=0"], 1)["records"][0]["loss"]
    assert first - no_seq >= 0.1 * 0.5  # coef * a sequence loss (>= 1 at perfect balance... > 0.5 surely)
    ungrouped = run(None, [*DEEPSEEK, "model.router_topk_groups=4"], 1)["records"][0]["loss"]
    assert abs(ungrouped - first) > 1e-5 * first  # group limits change which experts tokens reach
    weights = assemble([ref["weights"]])
    assert weights["layers.0.attn.kv_a_proj.weight"].shape == (8 + 4, 32)
    assert weights["layers.1.attn.kv_b_proj.weight"].shape == (4 * (8 + 6), 8)
