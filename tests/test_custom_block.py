"""The custom-block guide (docs/custom_block.md) runs, and its block is layout-independent."""
import re
from pathlib import Path

import pytest
import torch

from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.params import init_parameters
from parallel3d.tensor_parallel import scatter_to_sp
from parity import assemble, local_slices

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "custom_block.md"


def _block_class():
    code = re.search(r"```python\n(.*?)```", GUIDE.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(code, str(GUIDE), "exec"), namespace)  # the guide's code, exactly as documented
    return namespace["GeluMLPBlock"]


def _run(ctx, sp):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16, requires_grad=True)
    block = _block_class()(16, 24, ctx, sequence_parallel=sp)
    init_parameters(block, seed=3, default_std=0.2)
    x_in = scatter_to_sp(x, ctx.tp) if sp else x
    y = block(x_in)
    y.square().sum().backward()
    if sp:  # norm weight grads are partial under sp: sum them over TP
        from parallel3d.data_parallel.grads import reduce_gradients
        reduce_gradients(block.parameters(), ctx)
    return y.detach(), x.grad, local_slices(block, "grad")


def _worker(w, sp):
    return _run(w.context(MeshSpec(tp=w.world_size)), sp)


@pytest.mark.parametrize("sp", [False, True])
def test_custom_block_tp2_matches_single(worlds, sp):
    y_ref, xg_ref, g_ref = _run(ParallelContext.single(), False)
    results = worlds.run(2, _worker, sp)
    for rank, (y, xg, _) in enumerate(results):
        expected = y_ref.chunk(2, dim=1)[rank] if sp else y_ref
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xg, xg_ref, rtol=1e-5, atol=1e-5)
    grads = assemble([r[2] for r in results])
    for name, (t, _, _) in g_ref.items():
        torch.testing.assert_close(grads[name], t, rtol=1e-5, atol=1e-5)
