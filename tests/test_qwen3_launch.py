"""Qwen3-MoE through the public command line: convert_hf import -> pretrain.py (tp=2, torchrun) -> convert_hf
export -> transformers loads it, and its logits equal ours from the trained checkpoint."""
import numpy as np
import pytest
import torch
import yaml

from test_launch import _losses, _run

transformers = pytest.importorskip("transformers")


# make sweep: the same command-line round trip runs in CI for DeepSeek-V3 (test_deepseek_hf), and Qwen3's
# import, export and parity with transformers in test_qwen3_hf and test_qwen3_parity (11 s of CI)
@pytest.mark.sweep
def test_import_train_tp2_export_loads_in_transformers(tmp_path):
    from parallel3d.models.moe import MoETransformer
    from parallel3d.checkpoint.load import resolve_checkpoint_dir
    from parity import load_imported

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                                      max_position_embeddings=64)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    _run(["launch/convert_hf.py", "import", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")])
    conf = str(tmp_path / "ckpt" / "config.yaml")
    model = yaml.safe_load(open(conf))["model"]
    assert (model["head_dim"], model["qk_norm"], model["num_experts"], model["first_k_dense"]) == (16, True, 8, 1)
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 64, size=8 * 16 + 1).astype(np.uint16))
    log = tmp_path / "train.jsonl"
    _run(["launch/pretrain.py", "--config", conf, f"checkpoint.load_dir={tmp_path / 'ckpt'}",
          f"data.path={tmp_path / 'tokens.npy'}", "train.seq_len=16", "train.global_batch_size=2",
          "train.micro_batch_size=1", "train.steps=2", "train.lr=1e-2", "train.warmup_steps=0", "parallel.tp=2",
          f"checkpoint.save_dir={tmp_path / 'trained'}", f"log.jsonl={log}"], nproc=2)
    assert len(_losses(log)) == 2
    _run(["launch/convert_hf.py", "export", "--ckpt", str(tmp_path / "trained"), "--out", str(tmp_path / "out")])
    again = transformers.Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ours = load_imported(resolve_checkpoint_dir(str(tmp_path / "trained")), MoETransformer)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = again(ids).logits
        assert (ours(ids, torch.arange(16)) - logits).abs().max().item() <= 1e-4
        assert (logits - hf(ids).logits).abs().max().item() > 1e-3  # the two steps changed the model
