"""model.fused_head (default true): the last stage's loss through the chunked fused linear + cross-entropy.

Exactness is checked where users stand: the Trainer at several layouts with the fused head against the
world-size-1 run with the unfused head (loss rel 1e-5, weights after AdamW steps rtol 1e-4), the
evaluation path (Trainer.evaluate, what launch/evaluate.py runs), and at the model level with ignored
labels and vocabulary padding. Memory: no tensor of the logits' size is saved for backward.
"""
from __future__ import annotations

import pytest
import torch

from ckpt_helpers import build_trainer, context_for, make_config
from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Llama
from parallel3d.mesh import ParallelContext
from test_trainer_regressions import assert_parity, run

UNFUSED = ["model.fused_head=false"]


def test_fused_head_is_the_default():
    assert ModelConfig().fused_head is True
    assert make_config([], 1).model.fused_head is True


def _model_loss(fused: bool, labels: torch.Tensor, tie: bool):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=203, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=64, kernels="torch", fused_head=fused, tie_embeddings=tie)
    model = Llama(cfg, ParallelContext.single())
    model.init_weights(7)
    ids = torch.randint(0, 203, labels.shape)
    loss = model(ids, torch.arange(labels.shape[1]), labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("tie", [False, True])
def test_model_fused_matches_unfused_with_ignored_labels(tie, monkeypatch):
    import parallel3d.kernels.fused_linear_cross_entropy as flce
    monkeypatch.setattr(flce, "MIN_CHUNK_ROWS", 8)  # several chunks at this size (120 tokens, 7 chunks)
    labels = torch.randint(0, 203, (3, 40))
    labels[0, :7] = -100
    labels[2, -1] = -100
    fused, fused_grads = _model_loss(True, labels, tie)
    ref, ref_grads = _model_loss(False, labels, tie)
    torch.testing.assert_close(fused, ref, rtol=1e-6, atol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(fused_grads[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _largest_saved(fused: bool) -> tuple[int, int]:
    """(largest tensor numel saved for backward by a model forward, logits numel)."""
    cfg = ModelConfig(vocab_size=4096, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=64, kernels="torch", fused_head=fused)
    model = Llama(cfg, ParallelContext.single())
    ids = torch.randint(0, 4096, (2, 64))
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, torch.arange(64), ids)
    return max(sizes), ids.numel() * cfg.vocab_size


def test_fused_head_saves_no_logits():
    fused, logits = _largest_saved(True)
    unfused, _ = _largest_saved(False)
    assert unfused >= logits, "the unfused head saves the (tokens, vocab) softmax (the test relies on it)"
    assert fused == 4096 * 32, f"fused head: the largest saved tensor must be the head weight, got {fused}"


LAYOUTS = {
    "tp2_pad": (2, ["parallel.tp=2", "model.vocab_size=255"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
    "pp2_tied": (2, ["parallel.pp=2", "model.tie_embeddings=true", "model.num_layers=3"]),
    "tp2_tied_dp2": (4, ["parallel.tp=2", "model.tie_embeddings=true", "model.vocab_size=255"]),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fused_head_trainer_parity(worlds, name):
    """Fused head at a layout == unfused head at world size 1 (loss and weights after 3 AdamW steps)."""
    world, layout = LAYOUTS[name]
    ref = run(None, [*layout[1:], *UNFUSED], 3)
    assert_parity(worlds.run(world, run, layout, 3), ref)


def test_fused_head_trainer_world1():
    ref = run(None, UNFUSED, 3)
    assert_parity([run(None, [], 3)], ref)


def _evaluate(worker, overrides):
    torch.set_num_threads(1)
    cfg = make_config(overrides, 1 if worker is None else worker.world_size)
    trainer = build_trainer(cfg, context_for(cfg, worker))
    trainer.train_step()
    return trainer.evaluate(trainer.dataset, 2)


def test_evaluate_same_loss_fused_and_unfused(worlds):
    """Trainer.evaluate (launch/evaluate.py's path): the fused head gives the unfused loss, also under TP."""
    ref_loss, ref_tokens = _evaluate(None, UNFUSED)
    fused_loss, fused_tokens = _evaluate(None, [])
    assert fused_tokens == ref_tokens
    assert fused_loss == pytest.approx(ref_loss, rel=1e-6)
    padded_ref, _ = _evaluate(None, [*UNFUSED, "model.vocab_size=255"])
    for loss, _ in worlds.run(2, _evaluate, ["parallel.tp=2", "model.vocab_size=255"]):
        assert loss == pytest.approx(padded_ref, rel=1e-5)


def test_fused_head_peak_memory_llama3_8b_head(monkeypatch):
    """Peak bytes of the head's forward + backward at Llama-3 8B's head (8192 tokens, h 4096, v 128256,
    bf16), counted exactly on `meta` by benchmarks/head_memory.py: the fused head (gradients formed in the
    forward, 2048-row chunks) stays near the fp32 d weight accumulator it needs anyway (2 GiB) plus one chunk
    of logits, and at least 3.5x under the unfused head's."""
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import head_memory
    fused = head_memory.peak_bytes(True, 8192, 128256, 4096)
    unfused = head_memory.peak_bytes(False, 8192, 128256, 4096)
    assert fused <= 4.0 * 2 ** 30, fused / 2 ** 30
    assert unfused >= 3.5 * fused, (unfused / 2 ** 30, fused / 2 ** 30)
