"""The Llama trained with the Triton kernels forced on (interpreter on CPU) matches the torch path."""
import torch

from models.config import ModelConfig
from models.llama import Llama
from parallel3d.data_parallel.grads import reduce_gradients
from parallel3d.mesh import MeshSpec, ParallelContext

CFG = dict(vocab_size=48, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, ffn_hidden_size=40)


def _train(ctx, kernels: str, steps: int = 2, sp: bool = False):
    model = Llama(ModelConfig(**CFG, kernels=kernels), ctx, sequence_parallel=sp)
    model.init_weights(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 48, (2, 13), generator=g)
        opt.zero_grad()
        loss = model(tokens[:, :-1], torch.arange(12), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        reduce_gradients(model.parameters(), ctx)
        opt.step()
        losses.append(loss.item())
    return losses


def test_triton_path_matches_torch_path():
    ref = _train(ParallelContext.single(), "torch")
    got = _train(ParallelContext.single(), "triton")
    for a, b in zip(got, ref):
        assert abs(a - b) <= 1e-4 * abs(b)


def _tp_worker(w, kernels):
    return _train(w.context(MeshSpec(tp=2)), kernels, sp=True)


def test_triton_path_under_tensor_parallelism(worlds):
    ref = _train(ParallelContext.single(), "torch")
    for losses in worlds.run(2, _tp_worker, "triton", timeout=300):
        for a, b in zip(losses, ref):
            assert abs(a - b) <= 1e-4 * abs(b)
