"""The Triton kernels as torch.library custom ops (kernels.ops): under FakeTensorMode and on the meta
device every op gives the real op's output shapes and dtypes without running; torch.library.opcheck
checks schema, fake implementation and autograd registration against real runs (compiled on a GPU,
TRITON_INTERPRET=1 on the CPU)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from parallel3d.kernels import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton needs device tensors


def _cases(device=DEVICE, dtype=torch.float32):
    def t(*shape, dt=dtype):
        return torch.randn(*shape, dtype=dt, device=device)
    cos, sin = t(6, 8, dt=torch.float32), t(6, 8, dt=torch.float32)
    logits, target = t(5, 40), torch.randint(0, 40, (5,), device=device)
    return {
        "rmsnorm_fwd": (ops.rmsnorm_fwd, (t(2, 3, 16), t(16), 1e-5)),
        "rmsnorm_res_fwd": (ops.rmsnorm_res_fwd, (t(2, 3, 16), t(2, 3, 16), t(16), 1e-5)),
        "swiglu": (ops.swiglu, (t(4, 24), t(4, 24))),
        "rope": (ops.rope_op, (t(2, 6, 4, 8), t(2, 6, 2, 8), cos, sin, False)),
        "flash_attention_fwd": (ops.flash_attention_fwd, (t(1, 16, 4, 16), t(1, 16, 2, 16), t(1, 16, 2, 16), True,
                                                           None)),
        "grouped_mm": (ops.grouped_mm_op, (t(9, 16), t(3, 12, 16), [4, 0, 5], True)),
        "grouped_mm_wgrad": (ops.grouped_mm_wgrad, (t(9, 12), t(9, 16), [4, 0, 5])),
        "ce_partial_stats": (ops.ce_partial_stats, (logits, target, 0, -100)),
        "ce_partial_grad": (ops.ce_partial_grad, (logits, target, 0, t(5), t(5), -100)),
    }


def _meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _shapes(out):
    out = out if isinstance(out, tuple) else (out,)
    return [(tuple(o.shape), o.dtype) for o in out]


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fake_and_meta_shapes_match_real(name, dtype):
    op, args = _cases(dtype=dtype)[name]
    real = _shapes(op(*args))
    with FakeTensorMode() as mode:
        fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
        assert _shapes(op(*fake_args)) == real
    assert _shapes(op(*(_meta(a) for a in args))) == real


@pytest.mark.parametrize("name", ["rmsnorm_fwd", "rmsnorm_res_fwd", "swiglu", "rope", "grouped_mm"])
def test_opcheck(name):
    op, args = _cases()[name]
    args = tuple(a.requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def test_ops_compile_without_graph_breaks():
    """A block-like function of several ops compiles into one graph (fullgraph=True raises on a break)."""
    def f(x, w, gate, up):
        return ops.rmsnorm(x, w, 1e-5) * 2 + ops.swiglu(gate, up).sum()

    args = tuple(torch.randn(*shape, device=DEVICE) for shape in ((2, 16), (16,), (2, 8), (2, 8)))
    explained = torch._dynamo.explain(f)(*args)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
