"""Hugging Face Llama parity: import a tiny random transformers model, compare logits, export back."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from parallel3d.models.llama import Llama  # noqa: E402
from parallel3d.models.hf import export_hf, import_hf  # noqa: E402
from parity import enlarge_weights, load_imported  # noqa: E402


# Llama 3.1's RoPE scaling, shrunk: wavelengths beyond 16 / low_freq_factor positions are slowed 8x, those under
# 16 / high_freq_factor kept, the band between blended (the 24 positions compared reach past 16)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 50.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


def _hf_model(tied: bool, seed: int = 0, rope: dict | None = None):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=80, rms_norm_eps=1e-5,
                                   max_position_embeddings=64, tie_word_embeddings=tied,
                                   rope_parameters=rope or {"rope_type": "default", "rope_theta": 50.0})
    model = transformers.LlamaForCausalLM(cfg).eval()
    return enlarge_weights(model)


def _ours(ckpt_dir, **overrides) -> Llama:
    return load_imported(ckpt_dir, Llama, **overrides)


@pytest.mark.parametrize("tied, rope", [(False, None), (True, None), (False, LLAMA3_ROPE)],
                         ids=["untied", "tied", "llama3-rope-scaling"])
def test_import_logits_match_and_export_round_trips(tmp_path, tied, rope):
    hf = _hf_model(tied, rope=rope)
    hf.save_pretrained(tmp_path / "hf")
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ours = _ours(str(tmp_path / "ours"))
    ids = torch.randint(0, 97, (2, 24))
    pos = torch.arange(24)
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids, pos)
    assert (got - ref).abs().max().item() <= 1e-4
    # the comparison is sensitive: breaking RoPE (different theta) moves the logits far beyond tolerance
    broken = _ours(str(tmp_path / "ours"), rope_theta=1e6)
    with torch.no_grad():
        assert (broken(ids, pos) - ref).abs().max().item() > 1e-1
    # loss through the vocab-parallel path equals transformers' mean loss times the token count
    with torch.no_grad():
        loss = ours(ids[:, :-1], pos[:-1], ids[:, 1:]) / ids[:, 1:].numel()
        assert abs(loss.item() - hf(ids, labels=ids).loss.item()) < 1e-4

    export_hf(str(tmp_path / "ours"), str(tmp_path / "exported"))
    again = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "exported")).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, ref)
    exported = json.load(open(tmp_path / "exported" / "config.json"))
    assert exported["tie_word_embeddings"] == tied
    assert exported["rope_parameters"] == (rope or {"rope_type": "default", "rope_theta": 50.0})


def test_sharded_hf_checkpoint_with_index(tmp_path):
    hf = _hf_model(False, seed=1)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="20KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    import_hf(str(tmp_path / "hf"), str(tmp_path / "ours"))
    ids = torch.randint(0, 97, (1, 16))
    with torch.no_grad():
        assert (_ours(str(tmp_path / "ours"))(ids, torch.arange(16)) - hf(ids).logits).abs().max() <= 1e-4
