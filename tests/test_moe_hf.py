"""Hugging Face Mixtral parity: import a tiny random transformers Mixtral, compare logits, export back."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.models.moe import MoETransformer  # noqa: E402
from parallel3d.models.hf_mixtral import (export_mixtral, import_mixtral, mixtral_config_to_model_fields,  # noqa: E402
                               mixtral_to_ours, model_fields_to_mixtral_config, ours_to_mixtral)
from parallel3d.checkpoint.store import CheckpointError, CheckpointReader  # noqa: E402
from parity import enlarge_weights, load_imported  # noqa: E402

VOCAB, EXPERTS = 96, 4


def _hf_model(seed: int = 0, tied: bool = False):
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                                     num_experts_per_tok=2, max_position_embeddings=64, rope_theta=50.0,
                                     tie_word_embeddings=tied, attn_implementation="eager")
    model = transformers.MixtralForCausalLM(cfg).eval()
    return enlarge_weights(model)


def _ours(ckpt_dir, **overrides) -> MoETransformer:
    return load_imported(ckpt_dir, MoETransformer, **overrides)


@pytest.mark.parametrize("tied", [False, True])
def test_import_logits_match_and_export_round_trips(tmp_path, tied):
    hf = _hf_model(tied=tied)
    hf.save_pretrained(tmp_path / "hf")
    fields = import_mixtral(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert (fields["num_experts"], fields["moe_top_k"], fields["moe_ffn_hidden_size"]) == (EXPERTS, 2, 48)
    ours = _ours(str(tmp_path / "ours"))
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(24)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids, pos)
    assert (got - ref).abs().max().item() <= 1e-4
    # sensitive: top-1 routing instead of top-2 moves the logits far beyond tolerance
    with torch.no_grad():
        assert (_ours(str(tmp_path / "ours"), moe_top_k=1)(ids, pos) - ref).abs().max().item() > 1e-1
    export_mixtral(str(tmp_path / "ours"), str(tmp_path / "exported"))
    again = transformers.MixtralForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)  # bit-identical weights
    cfg = json.load(open(tmp_path / "exported" / "config.json"))
    assert cfg["num_local_experts"] == EXPERTS and cfg["tie_word_embeddings"] == tied


def test_in_memory_fused_names_map_like_saved_files(tmp_path):
    """transformers 5 fuses experts in memory (gate_up_proj); both spellings give the same tensors."""
    hf = _hf_model(seed=2)
    fused = mixtral_to_ours(hf.state_dict())
    assert fused["layers.0.mlp.experts.gate_proj"].shape == (EXPERTS, 48, 64)
    assert fused["layers.1.mlp.experts.down_proj"].shape == (EXPERTS, 64, 48)
    saved = ours_to_mixtral(fused)
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in saved
    back = mixtral_to_ours(saved)
    assert set(back) == set(fused) and all(torch.equal(back[k], fused[k]) for k in fused)
    hf.save_pretrained(tmp_path / "hf")
    import_mixtral(str(tmp_path / "hf"), str(tmp_path / "ours"))
    reader = CheckpointReader(str(tmp_path / "ours"))
    for name, t in fused.items():
        assert torch.equal(reader.read(name), t), name


def test_config_mapping_and_errors():
    hf = _hf_model().config.to_dict()
    fields = mixtral_config_to_model_fields(hf)
    ModelConfig(**fields).validate()
    assert fields["rope_theta"] == 50.0 and fields["router_score"] == "softmax" and fields["router_norm_topk"]
    back = model_fields_to_mixtral_config(fields)
    for key in ("num_local_experts", "num_experts_per_tok", "intermediate_size", "hidden_size", "num_key_value_heads"):
        assert back[key] == hf[key]
    with pytest.raises(CheckpointError, match="model_type 'llama'"):
        mixtral_config_to_model_fields({**hf, "model_type": "llama"})
    with pytest.raises(CheckpointError, match="sliding_window=16"):
        mixtral_config_to_model_fields({**hf, "sliding_window": 16})
    with pytest.raises(CheckpointError, match="num_shared_experts=1"):
        model_fields_to_mixtral_config({**fields, "num_shared_experts": 1})
    with pytest.raises(CheckpointError, match="router_score='sigmoid'"):
        model_fields_to_mixtral_config({**fields, "router_score": "sigmoid"})
    with pytest.raises(CheckpointError, match="Mixtral has no router bias"):
        ours_to_mixtral({"layers.0.mlp.router.expert_bias": torch.ones(4)})
    assert ours_to_mixtral({"layers.0.mlp.router.expert_bias": torch.zeros(4)}) == {}
