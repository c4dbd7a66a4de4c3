"""Measured model-state bytes per rank match docs/parallelism.md's ZeRO table (bf16 params and grads, fp32 master + m + v):
DP 16, ZeRO-1 4 + 12/N, ZeRO-2 2 + 14/N, ZeRO-3 16/N bytes per parameter, within 5%; and with the
default fp32 main gradients (4 bytes): DP 18, ZeRO-1 6 + 12/N, ZeRO-2 2 + 16/N, ZeRO-3 18/N."""
import pytest
import torch

from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Llama
from parallel3d.data_parallel import DataParallelConfig, attach
from parallel3d.mesh import MeshSpec
from test_dp_parity import BASE, S, global_batches

# (params, grads, optimizer) bytes per parameter as a function of N
FORMULA = {
    2: {0: (2, 2, 12), 1: (2, 2, lambda n: 12 / n), 2: (2, lambda n: 2 / n, lambda n: 12 / n),
        3: (lambda n: 2 / n, lambda n: 2 / n, lambda n: 12 / n)},
    4: {0: (2, 4, 12), 1: (2, 4, lambda n: 12 / n), 2: (2, lambda n: 4 / n, lambda n: 12 / n),
        3: (lambda n: 2 / n, lambda n: 4 / n, lambda n: 12 / n)},
}


def _measure(w, zero, grad_bytes):
    ctx = w.context(MeshSpec(dp=w.world_size))
    model = Llama(ModelConfig(**BASE), ctx)
    model.init_weights(7)
    n_params = sum(p.numel() for p in model.parameters())
    # the default bucket size (one bucket here): contiguous buckets pad only at their end (< N x 64 elements)
    opt = attach([model], ctx, DataParallelConfig(zero=zero, precision="bf16",
                                                  grad_dtype=torch.bfloat16 if grad_bytes == 2 else None))
    tokens = global_batches(64, 1)[0]
    per = tokens.shape[0] // w.world_size
    mine = tokens[w.rank * per: (w.rank + 1) * per]
    opt.zero_grad()
    opt.scale_loss(model(mine[:, :-1], torch.arange(S), mine[:, 1:]) / tokens[:, 1:].numel()).backward()
    opt.finish_grad_sync()
    before_step = opt.memory_bytes()
    opt.clip_grad_norm(1.0)
    assert opt.step(1e-3)
    return n_params, before_step, opt.memory_bytes()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("grad_bytes", [2, 4])
def test_zero_memory_formulas(worlds, n, grad_bytes):
    for zero in (0, 1, 2, 3):
        for n_params, mem, after in worlds.run(n, _measure, zero, grad_bytes):
            want = [f(n) if callable(f) else f for f in FORMULA[grad_bytes][zero]]
            got = [mem[k] / n_params for k in ("params", "grads", "optimizer")]
            for g, e, what in zip(got, want, ("params", "grads", "optimizer")):
                assert abs(g - e) <= 0.05 * e, (zero, n, what, got, want)
            total = sum(got)
            if grad_bytes == 2:   # the paper's totals
                paper = {0: 16, 1: 4 + 12 / n, 2: 2 + 14 / n, 3: 16 / n}[zero]
                assert abs(total - paper) <= 0.05 * paper, (zero, n, total, paper)
            assert after["params"] == mem["params"] and after["optimizer"] == mem["optimizer"]
