"""SwiGLU Triton kernel vs torch reference (TRITON_INTERPRET=1 on CPU, see conftest).

Tolerances: fp32 atol=rtol=1e-5; fp16 atol=rtol=2e-3; bf16 atol=rtol=2e-2 (one ulp; the interpreter
truncates on fp32->bf16); gradcheck in fp64 (fast mode).
"""
import pytest
import torch

from parallel3d.kernels import dispatch
from parallel3d.kernels.swiglu import swiglu, swiglu_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _check(gate, up, dtype):
    y, y_ref = swiglu(gate, up), swiglu_reference(gate, up)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    g = torch.randn_like(y)
    for a, b in zip(torch.autograd.grad(y, (gate, up), g), torch.autograd.grad(y_ref, (gate, up), g)):
        torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_swiglu_halves_of_fused_projection(dtype):
    """gate/up are the two (strided) halves of one (b, s, 2f) projection, f not a power of two."""
    torch.manual_seed(0)
    gate, up = torch.randn(3, 7, 2 * 150, dtype=dtype, device=DEVICE).chunk(2, dim=-1)
    _check(gate.requires_grad_(), up.detach().requires_grad_(), dtype)


def test_swiglu_contiguous_odd_shape_large_values():
    torch.manual_seed(1)
    gate = (8 * torch.randn(13, 37, device=DEVICE)).requires_grad_()  # saturated sigmoid both ways
    up = torch.randn(13, 37, device=DEVICE, requires_grad=True)
    _check(gate, up, torch.float32)


def test_swiglu_gradcheck_fp64():
    gate = torch.randn(3, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    up = torch.randn(3, 5, dtype=torch.float64, device=DEVICE, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (gate, up), fast_mode=True)


def test_dispatch_swiglu_backends_agree():
    gate, up = torch.randn(2, 3, 20, device=DEVICE), torch.randn(2, 3, 20, device=DEVICE)
    torch.testing.assert_close(dispatch.swiglu(gate, up, "triton"), dispatch.swiglu(gate, up, "torch"))


@pytest.mark.gpu
def test_swiglu_large_bf16_cuda():
    gate, up = torch.randn(2, 4096, 2 * 14336, dtype=torch.bfloat16, device="cuda").chunk(2, dim=-1)
    _check(gate.requires_grad_(), up.detach().requires_grad_(), torch.bfloat16)
