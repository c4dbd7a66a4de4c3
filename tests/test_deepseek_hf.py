"""Hugging Face DeepSeek-V3 parity: import a tiny random transformers DeepseekV3 (MLA, group-limited sigmoid
routing, shared experts, first-k dense, interleaved RoPE), compare logits and loss, export back."""
import importlib.util
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.models.hf import adapter_for_hf, export_hf, import_hf  # noqa: E402
from parallel3d.models.hf_deepseek import DeepseekV3Adapter, deepseek_config_to_fields, fields_to_deepseek_config  # noqa: E402
from parallel3d.models.moe import MoETransformer  # noqa: E402
from parallel3d.checkpoint.store import CheckpointError  # noqa: E402
from parity import enlarge_weights, load_imported  # noqa: E402

VOCAB, SEQ = 96, 24
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
        "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}


def hf_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
              kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16, n_group=4,
              topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64,
              routed_scaling_factor=2.5, rms_norm_eps=1e-5, attn_implementation="eager")
    kw.update(overrides)
    return transformers.DeepseekV3Config(**kw)


def hf_model(seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = enlarge_weights(transformers.DeepseekV3ForCausalLM(hf_config(**overrides)).eval())
    with torch.no_grad():  # a non-zero correction bias, so selection differs from the scores' own top-k
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)
    return model


def _ids():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


# YaRN's optional keys (gpt-oss-style configs): an untruncated correction range and an explicit cos/sin factor.
# At rope dim 8, theta 500 and an original context of 256 the range's ends are 0.16 and 2.39: truncated to
# [0, 3] the ramp (and so the frequencies) would differ
YARN_EXPLICIT = {**YARN, "original_max_position_embeddings": 256, "truncate": False, "attention_factor": 1.3}


@pytest.mark.parametrize("case", ["q_lora", "plain_q_yarn", "yarn_explicit", "tied_v_wide"])
def test_import_logits_and_loss_match_then_export_round_trips(tmp_path, case):
    overrides = {"q_lora": {}, "plain_q_yarn": dict(q_lora_rank=None, rope_parameters={"rope_theta": 500.0, **YARN}),
                 "yarn_explicit": dict(q_lora_rank=None, rope_parameters={"rope_theta": 500.0, **YARN_EXPLICIT}),
                 "tied_v_wide": dict(v_head_dim=32, tie_word_embeddings=True, first_k_dense_replace=0)}[case]
    hf = hf_model(**overrides)
    hf.save_pretrained(tmp_path / "hf")
    fields = import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    assert fields["attention_type"] == "mla" and fields["router_num_groups"] == 4
    ours = load_imported(str(tmp_path / "ours"), MoETransformer)
    ids, pos = _ids(), torch.arange(SEQ)
    with torch.no_grad():
        out = hf(ids, labels=ids)  # transformers shifts the labels
        got = ours(ids, pos)
        loss = ours(ids[:, :-1], pos[:-1], labels=ids[:, 1:]) / ids[:, 1:].numel()
    assert (got - out.logits).abs().max().item() <= 1e-4
    assert abs(loss.item() - out.loss.item()) <= 1e-5 * out.loss.item()
    # sensitive: ungrouped routing (and, below, dropping YaRN) moves the logits far beyond the tolerance
    with torch.no_grad():
        assert (load_imported(str(tmp_path / "ours"), MoETransformer, router_num_groups=1, router_topk_groups=1)(
            ids, pos) - out.logits).abs().max().item() > 1e-2
        if case == "plain_q_yarn":  # YaRN frequencies, attention factor and softmax mscale all count
            assert (load_imported(str(tmp_path / "ours"), MoETransformer, rope_scaling=None)(ids, pos)
                    - out.logits).abs().max().item() > 1e-2
    export_hf(str(tmp_path / "ours"), str(tmp_path / "exported"))
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                               attn_implementation="eager").eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, out.logits)  # bit-identical weights, layout restored
    cfg = json.load(open(tmp_path / "exported" / "config.json"))
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["rope_interleave"] is True


def test_rope_layout_matters(tmp_path):
    """Without the de-interleaving permutation the logits differ: the test above would catch a wrong one."""
    hf = hf_model(seed=3)
    hf.save_pretrained(tmp_path / "hf")
    cfg = json.load(open(tmp_path / "hf" / "config.json"))
    cfg["rope_interleave"] = False  # our import now keeps the rows as they are; transformers still interleaves
    json.dump(cfg, open(tmp_path / "hf" / "config.json", "w"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ours = load_imported(str(tmp_path / "ours"), MoETransformer)
    with torch.no_grad():
        assert (ours(_ids(), torch.arange(SEQ)) - hf(_ids()).logits).abs().max().item() > 1e-2


def test_in_memory_fused_names_and_config_mapping():
    hf = hf_model(seed=2)
    adapter = DeepseekV3Adapter()
    fields = adapter.config_from_hf(hf.config.to_dict())
    ModelConfig(**fields).validate()
    ours = adapter.from_hf(hf.state_dict().items())
    assert ours["layers.1.mlp.experts.gate_proj"].shape == (8, 24, 64)
    assert ours["layers.2.mlp.router.expert_bias"].abs().sum() > 0
    adapter.config_to_hf(fields)
    saved = {}
    for name, t in ours.items():
        saved.update(adapter.to_hf(name, t))
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in saved
    for name, t in hf.state_dict().items():
        if "experts.gate_up_proj" not in name and "experts.down_proj" not in name:
            assert torch.equal(saved[name], t), name
    back = fields_to_deepseek_config(fields)
    for key in ("n_routed_experts", "n_group", "topk_group", "kv_lora_rank", "q_lora_rank", "v_head_dim",
                "moe_intermediate_size", "first_k_dense_replace", "routed_scaling_factor"):
        assert back[key] == hf.config.to_dict()[key], key
    assert adapter_for_hf({"architectures": ["DeepseekV3ForCausalLM"]}).architecture == "DeepseekV3ForCausalLM"


def test_refusals():
    hf = hf_model().config.to_dict()
    with pytest.raises(CheckpointError, match="model_type 'llama'"):
        deepseek_config_to_fields({**hf, "model_type": "llama"})
    with pytest.raises(CheckpointError, match="FP8"):
        deepseek_config_to_fields({**hf, "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(CheckpointError, match="rope scaling 'linear'"):
        deepseek_config_to_fields({**hf, "rope_scaling": {"type": "linear", "factor": 2.0}})
    fields = deepseek_config_to_fields(hf)
    with pytest.raises(CheckpointError, match="capacity_factor=1.0"):
        fields_to_deepseek_config({**fields, "capacity_factor": 1.0})
    adapter = DeepseekV3Adapter()
    adapter.config_from_hf(hf)
    with pytest.raises(CheckpointError, match="dequantise"):
        adapter.from_hf([("model.layers.0.self_attn.q_a_proj.weight_scale_inv", torch.ones(1))])
    assert adapter.from_hf([("model.layers.3.eh_proj.weight", torch.ones(1))]) == {}  # MTP layer skipped


def test_cli_import_train_under_tp_export_matches_transformers(tmp_path):
    """Where users stand: convert_hf import -> pretrain.py (torchrun, tp=2 + sp) -> convert_hf export; the
    trained checkpoint and the exported directory give the same logits (ours vs transformers)."""
    import numpy as np
    from test_launch import ROOT, _losses, _run

    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "launch" / "convert_hf.py")
    convert_hf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert_hf)  # in-process: a subprocess would only add interpreter start-up
    hf_model(seed=4).save_pretrained(tmp_path / "hf")
    assert convert_hf.main(["import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, VOCAB, size=4 * 16 + 1).astype(np.uint16))
    log, saved = tmp_path / "train.jsonl", tmp_path / "trained"
    _run(["launch/pretrain.py", "--config", str(tmp_path / "ckpt" / "config.yaml"), "parallel.tp=2",
          "parallel.sp=true", f"data.path={tmp_path / 'tokens.npy'}", "train.seq_len=16", "train.global_batch_size=4",
          "train.micro_batch_size=2", "train.steps=2", "train.lr=1e-3", "model.seq_aux_loss_coef=0.01",
          "model.router_bias_update_rate=0.01", f"log.jsonl={log}", f"checkpoint.save_dir={saved}"], nproc=2)
    assert len(_losses(log)) == 2
    assert convert_hf.main(["export", "--ckpt", str(saved), "--out", str(tmp_path / "exported")]) == 0
    again = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "exported"),
                                                               attn_implementation="eager").eval()
    from parallel3d.checkpoint.load import resolve_checkpoint_dir
    ours = load_imported(resolve_checkpoint_dir(str(saved)), MoETransformer)
    imported = load_imported(str(tmp_path / "ckpt"), MoETransformer)
    ids, pos = _ids(), torch.arange(SEQ)
    with torch.no_grad():
        got, ref = ours(ids, pos), again(ids).logits
        assert (got - ref).abs().max().item() <= 1e-4
        assert (imported(ids, pos) - ref).abs().max().item() > 1e-3  # training moved the weights
    assert any(again.model.layers[2].mlp.gate.e_score_correction_bias != 0)  # the balancing bias travelled


def test_released_config_maps_onto_the_preset():
    """DeepSeek's published config.json (bf16-dequantised: no quantization_config) gives the preset's model."""
    from parallel3d.training.config import load_config

    released = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "aux_loss_alpha": 0.001,
                "first_k_dense_replace": 3, "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
                "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "n_group": 8,
                "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
                "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
                "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                "rms_norm_eps": 1e-06, "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
                "seq_aux": True, "topk_group": 4, "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
                "tie_word_embeddings": False, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40,
                "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "type": "yarn"}}
    fields = deepseek_config_to_fields(released)
    ModelConfig(**fields).validate()
    assert fields["rope_scaling"]["rope_type"] == "yarn" and fields["seq_aux_loss_coef"] == 0.001
    preset = load_config("configs/deepseek_v3.yaml", [], ModelConfig).model
    differ = {k for k, v in fields.items() if getattr(preset, k) != v}
    assert differ == {"rope_scaling", "max_seq_len", "init_std", "seq_aux_loss_coef"}, differ
    with pytest.raises(CheckpointError, match="scoring_func='softmax'"):
        deepseek_config_to_fields({**released, "scoring_func": "softmax"})


def test_dense_mla_model_exports_as_all_dense_deepseek_v3(tmp_path):
    """A dense model with MLA (no experts) is a DeepseekV3 whose every layer is dense: trained (1 step),
    exported, loaded by transformers with the same logits, and imported back to the same tensors."""
    from ckpt_helpers import train
    from parallel3d.models.llama import Llama
    from parallel3d.checkpoint.load import resolve_checkpoint_dir
    from parallel3d.checkpoint.store import CheckpointReader
    from test_deepseek_parity import DEEPSEEK

    dense = [o for o in DEEPSEEK if not any(w in o for w in ("expert", "router", "moe", "first_k", "aux", "routed"))]
    train(None, [*dense, "model.q_lora_rank=0", "model.rope_scaling={rope_type: yarn, factor: 2.0, "
                 "original_max_position_embeddings: 16, mscale_all_dim: 1.0}"], 1, str(tmp_path / "run"), (1,))
    ckpt = resolve_checkpoint_dir(str(tmp_path / "run"))
    export_hf(ckpt, str(tmp_path / "hf"))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager").eval()
    assert hf.config.first_k_dense_replace == hf.config.num_hidden_layers
    ours = load_imported(ckpt, Llama)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids, torch.arange(16)) - hf(ids).logits).abs().max().item() <= 1e-4
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    a, b = CheckpointReader(ckpt), CheckpointReader(str(tmp_path / "back"))
    for name in ("layers.1.attn.q_proj.weight", "layers.0.attn.kv_a_proj.weight", "layers.1.mlp.up_proj.weight"):
        assert torch.equal(a.read(name), b.read(name)), name
