"""Activation checkpointing: identical losses and gradients, fewer saved activation bytes."""
import pytest
import torch

from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Llama
from parallel3d.mesh import ParallelContext

CFG = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=64)


def _run(recompute: str):
    model = Llama(ModelConfig(**CFG), ParallelContext.single(), recompute=recompute)
    model.init_weights(5)
    tokens = torch.randint(0, 64, (2, 33), generator=torch.Generator().manual_seed(0))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens[:, :-1], torch.arange(32), tokens[:, 1:])
    saved_bytes = sum(saved)  # bytes held for backward after the forward (outer graph only)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}, saved_bytes


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_matches_and_saves_memory(mode):
    loss_ref, grads_ref, bytes_ref = _run("none")
    loss, grads, saved = _run(mode)
    assert loss == loss_ref
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=0, atol=1e-7)
    assert saved < bytes_ref, (mode, saved, bytes_ref)
    if mode == "full":
        assert saved < 0.5 * bytes_ref


def test_bad_mode():
    with pytest.raises(ValueError, match="activation checkpointing must be none, full or selective"):
        Llama(ModelConfig(**CFG), ParallelContext.single(), recompute="sometimes")
