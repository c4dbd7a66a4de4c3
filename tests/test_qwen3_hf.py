"""Hugging Face Qwen3, Qwen3-MoE (and Qwen2's q/k/v biases) parity at world size 1, fp32: import a tiny random
transformers model, compare logits and loss, check the comparison is sensitive, export back, and export after
training through the real Trainer."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ckpt_helpers import build_trainer, context_for, make_config  # noqa: E402
from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.models.hf import adapter_for_model, export_hf, import_hf  # noqa: E402
from parallel3d.models.hf_qwen3 import (fields_to_qwen3_moe_config, qwen3_config_to_fields, qwen3_moe_config_to_fields,  # noqa: E402
                             ours_tensor_to_qwen, qwen_to_ours)
from parallel3d.models.llama import Llama  # noqa: E402
from parallel3d.models.moe import MoETransformer  # noqa: E402
from parallel3d.checkpoint import save_checkpoint  # noqa: E402
from parallel3d.checkpoint.store import CheckpointError  # noqa: E402
from parity import enlarge_weights, load_imported  # noqa: E402

VOCAB = 96
# head_dim 24 != hidden 64 / 4 heads: the attention width (96) is decoupled from the hidden size, as in Qwen3
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 50.0},
              rms_norm_eps=1e-6, attn_implementation="eager")


def _hf(kind: str, tied: bool = False, seed: int = 0, **extra):
    torch.manual_seed(seed)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **COMMON, head_dim=24, intermediate_size=80, tie_word_embeddings=tied, **extra))
    elif kind == "qwen3_moe":
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **COMMON, head_dim=24, intermediate_size=80, moe_intermediate_size=16, num_experts=8,
            num_experts_per_tok=3, mlp_only_layers=[0], tie_word_embeddings=tied, **extra))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON, intermediate_size=80,
                                                                       tie_word_embeddings=tied, **extra))
    return enlarge_weights(model.eval())


CLASSES = {"qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "qwen2": transformers.Qwen2ForCausalLM}
CASES = [("qwen3", False, {}), ("qwen3", True, {}), ("qwen3_moe", False, {"norm_topk_prob": True}),
         ("qwen3_moe", True, {"norm_topk_prob": False}), ("qwen2", False, {})]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("kind,tied,extra", CASES, ids=lambda c: str(c))
def test_import_logits_loss_and_export_round_trip(tmp_path, kind, tied, extra):
    hf = _hf(kind, tied, **extra)
    hf.save_pretrained(tmp_path / "hf")
    fields = import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    cls = MoETransformer if kind == "qwen3_moe" else Llama

    def ours(**overrides):  # no balancing loss: transformers leaves it out of `loss` without router logits
        return load_imported(str(tmp_path / "ours"), cls, **{"aux_loss_coef": 0.0, **overrides})
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)
    with torch.no_grad():
        ref = hf(ids).logits
        model = ours()
        assert _max_diff(model(ids, pos), ref) <= 1e-4
        loss = model(ids[:, :-1], pos[:-1], ids[:, 1:]) / ids[:, 1:].numel()
        assert abs(loss.item() - hf(ids, labels=ids).loss.item()) < 1e-4
        # sensitive: each Qwen feature moves the logits far beyond the tolerance when switched off
        if kind == "qwen2":
            for block in model.layers.values():
                for proj in (block.attn.q_proj, block.attn.k_proj):
                    proj.bias.zero_()
            assert _max_diff(model(ids, pos), ref) > 1e-1
        else:
            assert fields["head_dim"] == 24 and fields["qk_norm"]
            assert _max_diff(ours(qk_norm=False)(ids, pos), ref) > 1e-1
        if kind == "qwen3_moe":
            assert fields["router_norm_topk"] == extra["norm_topk_prob"] and fields["first_k_dense"] == 1
            flipped = ours(router_norm_topk=not extra["norm_topk_prob"])
            assert _max_diff(flipped(ids, pos), ref) > 1e-1

    export_hf(str(tmp_path / "ours"), str(tmp_path / "exported"))
    again = CLASSES[kind].from_pretrained(str(tmp_path / "exported"), attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)  # bit-identical weights, same config
    cfg = json.load(open(tmp_path / "exported" / "config.json"))
    assert cfg["tie_word_embeddings"] == tied and cfg["architectures"] == [CLASSES[kind].__name__]


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "llama"])
def test_export_after_training_matches_our_logits(tmp_path, kind):
    """Three AdamW steps through the real Trainer (QK-norm weights move), save, export, load in transformers.
    `llama`: the same decoupled head_dim without QK-norm exports as Llama and imports back."""
    moe = kind == "qwen3_moe"
    overrides = [f"model.qk_norm={str(kind != 'llama').lower()}", "model.head_dim=16", "model.vocab_size=128",
                 "train.steps=3", "model.norm_eps=1e-6"]
    if moe:
        overrides += ["model.num_experts=8", "model.moe_top_k=2", "model.moe_ffn_hidden_size=16",
                      "model.router_norm_topk=false", "model.first_k_dense=1", "model.aux_loss_coef=0.01"]
    cfg = make_config(overrides, 1)
    trainer = build_trainer(cfg, context_for(cfg))
    for _ in range(3):
        trainer.train_step()
    model = trainer.chunks[0]
    if kind != "llama":
        assert not torch.equal(model.layers["1"].attn.q_norm.weight, torch.ones(16))  # trained, not the init
    save_checkpoint(trainer, str(tmp_path / "ckpt"))
    export_hf(str(tmp_path / "ckpt" / "step_00000003"), str(tmp_path / "hf"))
    cls = {"qwen3": transformers.Qwen3ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
           "llama": transformers.LlamaForCausalLM}[kind]
    hf = cls.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    assert hf.config.head_dim == 16 and hf.config.hidden_size == 32
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids).logits
        assert _max_diff(model.eval()(ids, torch.arange(32)), ref) <= 1e-4
    if kind == "llama":  # and back: import keeps the decoupled head_dim
        assert import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))["head_dim"] == 16
        with torch.no_grad():
            assert _max_diff(load_imported(str(tmp_path / "back"), Llama)(ids, torch.arange(32)), ref) <= 1e-4


@pytest.mark.parametrize("overrides,message", [
    (["model.head_dim=-1"], "model.head_dim=-1 must be >= 0"),
    (["model.head_dim=15"], "model.head_dim=15 must be even"),
    (["model.hidden_size=60"], "hidden_size=60 is not divisible by model.num_heads=8"),
])
def test_bad_head_dim_is_one_clear_error(overrides, message):
    from parallel3d.training.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        make_config(["model.num_heads=8", *overrides], 1)


def test_head_dim_decouples_the_attention_width():
    cfg = make_config(["model.hidden_size=60", "model.num_heads=8", "model.num_kv_heads=2", "model.head_dim=16",
                       "model.qk_norm=true", "model.qkv_bias=true"], 1)  # 60 % 8 != 0 is fine with head_dim set
    block = Llama(cfg.model, context_for(cfg)).layers["0"]
    assert block.attn.q_proj.weight.shape == (128, 60) and block.attn.o_proj.weight.shape == (60, 128)
    assert block.attn.k_proj.bias.shape == (32,) and block.attn.q_norm.weight.shape == (16,)


def test_in_memory_fused_expert_names_map_like_saved_files(tmp_path):
    hf = _hf("qwen3_moe", seed=2)
    fused = qwen_to_ours(hf.state_dict().items(), "Qwen3-MoE")
    assert fused["layers.1.mlp.experts.gate_proj"].shape == (8, 16, 64)
    assert fused["layers.1.mlp.experts.down_proj"].shape == (8, 64, 16)
    assert fused["layers.0.mlp.gate_proj.weight"].shape == (80, 64)  # the dense first layer
    hf.save_pretrained(tmp_path / "hf")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        saved = qwen_to_ours(((k, f.get_tensor(k)) for k in f.keys()), "Qwen3-MoE")
    assert set(saved) == set(fused) and all(torch.equal(saved[k], fused[k]) for k in fused)


def test_config_mapping_and_refusals():
    hf = _hf("qwen3_moe").config.to_dict()
    fields = qwen3_moe_config_to_fields(hf)
    ModelConfig(**fields).validate()
    assert (fields["num_experts"], fields["moe_top_k"], fields["moe_ffn_hidden_size"]) == (8, 3, 16)
    back = fields_to_qwen3_moe_config(fields)
    assert back["num_experts"] == hf["num_local_experts"] == 8  # config.json spells the attribute-mapped name
    for key in ("num_experts_per_tok", "moe_intermediate_size", "intermediate_size", "head_dim",
                "norm_topk_prob", "mlp_only_layers", "num_key_value_heads"):
        assert back[key] == hf[key], key
    with pytest.raises(CheckpointError, match="mlp_only_layers"):
        qwen3_moe_config_to_fields({**hf, "mlp_only_layers": [1]})
    with pytest.raises(CheckpointError, match="use_sliding_window=True"):
        qwen3_moe_config_to_fields({**hf, "use_sliding_window": True})
    dense = _hf("qwen3").config.to_dict()
    with pytest.raises(CheckpointError, match="attention_bias"):
        qwen3_config_to_fields({**dense, "attention_bias": True})
    with pytest.raises(CheckpointError, match="rope_type='yarn'"):
        qwen3_config_to_fields({**dense, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(CheckpointError, match="model_type 'qwen3'"):
        qwen3_moe_config_to_fields(dense)
    with pytest.raises(CheckpointError, match="router_score='sigmoid'"):
        fields_to_qwen3_moe_config({**fields, "router_score": "sigmoid"})
    # export picks the family by the model's features; Qwen features never fall through to Llama / Mixtral
    assert adapter_for_model(fields).architecture == "Qwen3MoeForCausalLM"
    with pytest.raises(CheckpointError, match="qkv_bias=True"):
        adapter_for_model({**fields, "qk_norm": False, "qkv_bias": True}).config_to_hf(
            {**fields, "qk_norm": False, "qkv_bias": True})
    dense_fields = qwen3_config_to_fields(dense)
    assert adapter_for_model(dense_fields).architecture == "Qwen3ForCausalLM"
    assert adapter_for_model({**dense_fields, "qk_norm": False, "qkv_bias": True}).architecture == "Qwen2ForCausalLM"
    assert adapter_for_model({**dense_fields, "qk_norm": False}).architecture == "LlamaForCausalLM"


@pytest.mark.parametrize("preset", ["qwen3_8b", "qwen3_30b_a3b", "qwen3_235b_a22b"])
def test_presets_have_the_published_sizes(preset):
    """The preset exported as a Hugging Face config builds (on the meta device) a transformers model with
    exactly the parameters our count gives: 8.19B for Qwen3-8B; 30.5B total (3.3B active) for Qwen3-30B-A3B;
    235B (22B active) for Qwen3-235B-A22B."""
    import dataclasses

    from parallel3d.training.config import load_config
    from parallel3d.training.metrics import active_params, flops_per_token, total_params

    model = load_config(f"configs/{preset}.yaml", [], ModelConfig).model
    fields = dataclasses.asdict(model)
    hf_cfg = adapter_for_model(fields).config_to_hf(fields)
    cls = transformers.Qwen3MoeForCausalLM if model.num_experts else transformers.Qwen3ForCausalLM
    config_cls = transformers.Qwen3MoeConfig if model.num_experts else transformers.Qwen3Config
    with torch.device("meta"):
        hf = cls(config_cls(**{k: v for k, v in hf_cfg.items() if k not in ("architectures", "model_type")}))
    assert sum(p.numel() for p in hf.parameters()) == total_params(model)
    expected = {"qwen3_8b": (8.19e9, 8.19e9), "qwen3_30b_a3b": (30.5e9, 3.3e9),
                "qwen3_235b_a22b": (235e9, 22e9)}[preset]  # model cards
    assert total_params(model) == pytest.approx(expected[0], rel=0.01)
    assert active_params(model) == pytest.approx(expected[1], rel=0.02)
    # attention score and value FLOPs grow with the attention width, heads x 128 (32 or 64), not hidden_size
    assert flops_per_token(model, 2) - flops_per_token(model, 1) == 12 * model.num_layers * model.num_heads * 128


# The published config.json files (Hugging Face Hub, Qwen/Qwen3-8B and Qwen/Qwen3-30B-A3B; transformers-4
# spelling: top-level rope_theta, rope_scaling null), less tokenizer ids and dtype.
PUBLISHED = {
    "qwen3_8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
                 "attention_dropout": 0.0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
                 "initializer_range": 0.02, "intermediate_size": 12288, "max_position_embeddings": 40960,
                 "max_window_layers": 36, "num_attention_heads": 32, "num_hidden_layers": 36,
                 "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
                 "sliding_window": None, "tie_word_embeddings": False, "use_sliding_window": False,
                 "vocab_size": 151936},
    "qwen3_30b_a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False,
                      "attention_dropout": 0.0, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
                      "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
                      "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                      "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
                      "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
                      "output_router_logits": False, "rms_norm_eps": 1e-06, "rope_scaling": None,
                      "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
                      "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 151936},
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_published_config_imports_as_the_preset_model(preset):
    import dataclasses

    from parallel3d.models.hf import adapter_for_hf
    from parallel3d.training.config import load_config

    fields = adapter_for_hf(PUBLISHED[preset]).config_from_hf(PUBLISHED[preset])
    model = dataclasses.asdict(load_config(f"configs/{preset}.yaml", [], ModelConfig).model)
    assert {k: model[k] for k in fields} == fields


def test_qwen3_moe_export_refuses_what_it_cannot_express():
    """A non-zero router bias or shared experts would change the model Qwen3-MoE loads: refused by name;
    a zero bias (our default buffer) is dropped and the experts split per expert."""
    with pytest.raises(CheckpointError, match="Qwen3-MoE has no router bias"):
        ours_tensor_to_qwen("layers.0.mlp.router.expert_bias", torch.ones(4))
    with pytest.raises(CheckpointError, match="Qwen3-MoE has no shared experts"):
        ours_tensor_to_qwen("layers.0.mlp.shared_experts.gate_proj.weight", torch.ones(2, 2))
    assert ours_tensor_to_qwen("layers.0.mlp.router.expert_bias", torch.zeros(4)) == {}
    w = torch.arange(24.0).reshape(2, 3, 4)
    out = ours_tensor_to_qwen("layers.1.mlp.experts.down_proj", w)
    assert sorted(out) == ["model.layers.1.mlp.experts.0.down_proj.weight", "model.layers.1.mlp.experts.1.down_proj.weight"]
    assert torch.equal(out["model.layers.1.mlp.experts.1.down_proj.weight"], w[1])
