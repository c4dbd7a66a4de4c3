"""Whole-Llama tensor-parallel parity against world size 1: loss, gradients, weights after 3 AdamW steps."""
import pytest
import torch

from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Llama
from parallel3d.data_parallel.grads import reduce_gradients
from parallel3d.mesh import MeshSpec, ParallelContext
from parity import PARITY_ADAM, WEIGHT_ATOL, assemble, assert_close_dicts, local_slices

STEPS = 3


def train(ctx: ParallelContext, model_kwargs: dict, sp: bool, seed: int = 7):
    cfg = ModelConfig(**model_kwargs)
    model = Llama(cfg, ctx, sequence_parallel=sp)
    model.init_weights(seed)
    opt = torch.optim.AdamW(model.parameters(), **PARITY_ADAM)
    g = torch.Generator().manual_seed(seed)
    b, s = 2, 16
    losses, grads = [], None
    for step in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
        opt.zero_grad()
        loss = model(tokens[:, :-1], torch.arange(s), tokens[:, 1:]) / (b * s)
        loss.backward()
        reduce_gradients(model.parameters(), ctx)
        if step == 0:
            grads = local_slices(model, "grad")
        opt.step()
        losses.append(loss.item())
    return losses, grads, local_slices(model, "data")


def _worker(w, model_kwargs, sp):
    return train(w.context(MeshSpec(tp=w.world_size)), model_kwargs, sp)


BASE = dict(vocab_size=96, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4, ffn_hidden_size=80)
CASES = [  # (tp, sp, overrides)
    (2, False, {}),
    (2, True, dict(tie_embeddings=True)),
    (4, True, dict(num_kv_heads=2, vocab_size=97)),          # kv heads fewer than tp, vocab not divisible
    (4, False, dict(num_kv_heads=8, tie_embeddings=True, vocab_size=97)),  # kv heads more than tp
    (2, True, dict(num_kv_heads=1)),                         # multi-query attention
]


@pytest.mark.parametrize("tp,sp,overrides", CASES, ids=[f"tp{c[0]}-sp{int(c[1])}-{c[2]}" for c in CASES])
def test_llama_tp_parity(worlds, tp, sp, overrides):
    kwargs = {**BASE, **overrides}
    ref_losses, ref_grads, ref_weights = train(ParallelContext.single(), kwargs, False)
    results = worlds.run(tp, _worker, kwargs, sp)
    for losses, _, _ in results:
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b)
    assert_close_dicts(assemble([r[1] for r in results]), {n: t for n, (t, _, _) in ref_grads.items()},
                       what="grad")
    assert_close_dicts(assemble([r[2] for r in results]), {n: t for n, (t, _, _) in ref_weights.items()},
                       atol=WEIGHT_ATOL, what="weight")
