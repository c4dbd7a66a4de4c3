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
        "swiglu": (ops.swiglu_op, (t(4, 24), t(4, 24))),
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


def _wrapper_cases(device=DEVICE):
    """ops' public wrappers with inputs needing gradients: name -> (call, inputs, its custom op, the kernel
    module's autograd Function an eager call takes instead)."""
    from parallel3d.kernels import flash_attention as fa, grouped_gemm as gg, rmsnorm as rn, rope as rp, swiglu as sw

    def t(*shape):
        return torch.randn(*shape, dtype=torch.float32, device=device, requires_grad=True)
    cos, sin = torch.randn(6, 8, device=device), torch.randn(6, 8, device=device)
    return {
        "rmsnorm": (lambda a: ops.rmsnorm(*a, 1e-5), (t(2, 3, 16), t(16)), "rmsnorm_fwd", rn.RMSNormFunction),
        "rmsnorm_residual": (lambda a: ops.rmsnorm_residual(*a, 1e-5), (t(2, 3, 16), t(2, 3, 16), t(16)),
                             "rmsnorm_res_fwd", rn.RMSNormResidualFunction),
        "swiglu": (lambda a: ops.swiglu(*a), (t(4, 24), t(4, 24)), "swiglu", sw.SwiGLUFunction),
        "rope": (lambda a: ops.rope(*a, cos, sin), (t(2, 6, 4, 8), t(2, 6, 2, 8)), "rope", rp.RoPEFunction),
        "flash_attention": (lambda a: ops.flash_attention(*a, True), (t(1, 16, 4, 16), t(1, 16, 2, 16),
                            t(1, 16, 2, 16)), "flash_attention_fwd", fa.FlashAttentionFunction),
        "grouped_mm": (lambda a: ops.grouped_mm(*a, [4, 0, 5]), (t(9, 16), t(3, 12, 16)), "grouped_mm", gg.GroupedMM),
    }


class OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the name of every op dispatched (a watcher like the planner's StepTracker; also used by
    tests/test_kernels_fp8_cast.py)."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


def _run(call, inputs):
    out = call(inputs)
    out = out if isinstance(out, tuple) else (out,)
    loss = sum((o.float() * (i + 1)).sum() for i, o in enumerate(out))   # every output, weighted apart
    return out, torch.autograd.grad(loss, inputs)


@pytest.mark.parametrize("name", list(_wrapper_cases()))
def test_eager_calls_skip_the_custom_op_layer_and_watchers_see_the_op(name):
    """Eagerly, a wrapper runs the kernel's autograd Function (about half the host time: RESULTS.md), with the
    custom op's outputs and gradients bit for bit; under a dispatch mode (the planner's StepTracker,
    FakeTensorMode), the profiler, torch.compile and on `meta` the custom op runs, so what watches the op
    graph still sees parallel3d's ops."""
    call, inputs, op_name, function = _wrapper_cases()[name]
    assert ops.direct(*inputs)
    out, grads = _run(call, inputs)
    assert type(out[0].grad_fn).__name__ == f"{function.__name__}Backward"
    watcher = OpNames()
    with watcher:
        assert not ops.direct(*inputs)
        out_op, grads_op = _run(call, inputs)
    assert f"parallel3d::{op_name}" in watcher.names
    for a, b in zip(out + grads, out_op + grads_op):
        assert torch.equal(a, b)
    assert not ops.direct(*(x.detach().to("meta") for x in inputs))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert not ops.direct(*inputs)


def test_host_cost_benchmark_runs_and_restores_the_kernels(capsys):
    """benchmarks/op_host_cost.py (launches stubbed, a few calls): one row per path, the kernels restored."""
    import importlib
    import sys
    from pathlib import Path
    from parallel3d.kernels import rmsnorm as rn, rope as rp
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("op_host_cost")
    kept = dict(vars(rn)), dict(vars(rp))
    assert bench.main(["--calls", "20", "--repeats", "1", "--stub"]) == 0
    assert (dict(vars(rn)), dict(vars(rp))) == kept
    rows = [line for line in capsys.readouterr().out.splitlines() if " best " in line]
    assert [r.split(",")[0] for r in rows] == ["rmsnorm"] * 3 + ["rope"] * 2
