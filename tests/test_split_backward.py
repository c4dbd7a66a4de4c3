"""The zero-bubble split backward (pipeline/backward.py) does one backward's work, not more: the input pass
and the weight pass together run exactly the matmuls of one plain backward, and give the same gradients."""
from __future__ import annotations

import math
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Llama
from parallel3d.mesh import ParallelContext
from parallel3d.params import init_parameters
from parallel3d.pipeline.backward import backward_input, backward_weight

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
           torch.ops.aten.mm.out, torch.ops.aten.addmm_.default, torch.ops.aten.addmm.out}  # (the fused head's)


class MatmulFlops(TorchDispatchMode):
    """FLOPs of every mm / bmm / addmm, by (op, shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.flops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in MATMULS:
            a, b = [x for x in args if isinstance(x, torch.Tensor)][-2:]
            self.flops[(str(func), tuple(a.shape), tuple(b.shape))] += 2 * math.prod(a.shape) * b.shape[-1]
        return out


def _stage_and_output():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=128, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=128, max_seq_len=32)
    stage = Llama(cfg, ParallelContext.single(), layers=range(0, 3), pre=False, post=False)  # a middle stage
    init_parameters(stage, seed=0)
    x = torch.randn(2, 32, 64, requires_grad=True)  # (b, s, h): the received activation
    y = stage(x, torch.arange(32))
    return stage, x, y, torch.randn_like(y)


def test_split_backward_runs_one_backwards_matmuls_and_gives_its_gradients():
    stage, x, y, dy = _stage_and_output()
    plain = MatmulFlops()
    with plain:
        torch.autograd.backward([y], [dy], inputs=[x, *stage.parameters()])
    want = {n: p.grad.clone() for n, p in stage.named_parameters()}
    dx_want = x.grad.clone()

    stage, x, y, dy = _stage_and_output()
    split = MatmulFlops()
    with split:
        dx, work = backward_input(y, dy, x, list(stage.parameters()))
        assert all(p.grad is None for p in stage.parameters())  # the input pass writes no weight gradient
        backward_weight(work)
    assert split.flops == plain.flops  # the same GEMMs, each once (before the fix: every dX GEMM twice)
    assert torch.allclose(dx, dx_want, rtol=1e-5, atol=1e-7)
    for n, p in stage.named_parameters():
        assert torch.allclose(p.grad, want[n], rtol=1e-5, atol=1e-7), n


def _head_stage_and_loss(form: str):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=96, hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=128,
                      max_seq_len=32, kernels="torch", fused_head_form=form)
    stage = Llama(cfg, ParallelContext.single(), layers=range(0, 1), pre=False, post=True)  # the head's stage
    init_parameters(stage, seed=0)
    x = torch.randn(2, 32, 64, requires_grad=True)  # (b, s, h)
    labels = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    return stage, x, stage(x, torch.arange(32), labels)


def test_the_per_token_head_forms_in_each_pass_only_the_gradient_it_wants():
    """The fused head's per_token form under the split backward (zb-h1's head stage, model.fused_head_form=
    per_token): its one autograd node runs in the input pass and again in the weight pass. Each recomputes the
    logits once and forms only what that pass wants (d hidden, then d weight), so the split runs one plain
    backward's matmuls plus the one extra logits recomputation, not a whole second head backward; the
    gradients are the plain backward's. The summed form (gradients formed in its forward) runs none there."""
    n, h, v = 64, 64, 96
    for form, extra in (("per_token", {("aten.mm.default", (n, h), (h, v)): 2 * n * h * v}), ("summed", {})):
        stage, x, loss = _head_stage_and_loss(form)
        plain = MatmulFlops()
        with plain:
            torch.autograd.backward([loss], inputs=[x, *stage.parameters()])
        want = {name: p.grad.clone() for name, p in stage.named_parameters()}
        dx_want = x.grad.clone()

        stage, x, loss = _head_stage_and_loss(form)
        split = MatmulFlops()
        with split:
            dx, work = backward_input(loss, torch.ones_like(loss), x, list(stage.parameters()))
            assert all(p.grad is None for p in stage.parameters())
            backward_weight(work)
        assert split.flops == plain.flops + Counter(extra), form
        torch.testing.assert_close(dx, dx_want, rtol=1e-5, atol=1e-7)
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-7, msg=f"{form} {name}")
