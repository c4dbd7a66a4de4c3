"""RMSNorm Triton kernel vs torch reference (TRITON_INTERPRET=1 on CPU, see conftest).

Tolerances: fp32 atol=rtol=1e-5; bf16 atol=rtol=2e-2 (one bf16 ulp is 2^-8 relative, and the
interpreter rounds fp32->bf16 by truncation); gradcheck in fp64 (fast mode).
"""
import pytest
import torch

from parallel3d.kernels import dispatch
from parallel3d.kernels.rmsnorm import rmsnorm, rmsnorm_reference, rmsnorm_residual, rmsnorm_residual_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 100), (2, 5, 33)])
def test_rmsnorm_matches_reference(dtype, shape):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype, device=DEVICE, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1], device=DEVICE)).to(dtype).requires_grad_()
    y, y_ref = rmsnorm(x, w, 1e-6), rmsnorm_reference(x, w, 1e-6)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    g = torch.randn_like(y)
    for a, b in zip(_grads(y, (x, w), g), _grads(y_ref, (x, w), g)):
        # dw sums over all rows: compare relative to its scale
        torch.testing.assert_close(a, b, atol=TOL[dtype]["atol"] * max(1.0, b.abs().max().item()),
                                   rtol=TOL[dtype]["rtol"])


def test_rmsnorm_fp32_weight_bf16_input_promotes_like_reference():
    x = torch.randn(7, 48, dtype=torch.bfloat16, device=DEVICE)
    w = torch.randn(48, device=DEVICE)
    y, y_ref = rmsnorm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5)
    assert y.dtype == y_ref.dtype == torch.float32
    torch.testing.assert_close(y, y_ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_residual_matches_reference(dtype):
    torch.manual_seed(1)
    x = torch.randn(3, 11, 72, dtype=dtype, device=DEVICE, requires_grad=True)
    r = torch.randn(3, 11, 72, dtype=dtype, device=DEVICE, requires_grad=True)
    w = torch.randn(72, dtype=dtype, device=DEVICE, requires_grad=True)
    y, s = rmsnorm_residual(x, r, w, 1e-6)
    y_ref, s_ref = rmsnorm_residual_reference(x, r, w, 1e-6)
    torch.testing.assert_close(s, s_ref, **TOL[dtype])
    torch.testing.assert_close(y, y_ref, **TOL[dtype])
    gy, gs = torch.randn_like(y), torch.randn_like(s)
    for a, b in zip(_grads((y, s), (x, r, w), (gy, gs)), _grads((y_ref, s_ref), (x, r, w), (gy, gs))):
        torch.testing.assert_close(a, b, atol=TOL[dtype]["atol"] * max(1.0, b.abs().max().item()),
                                   rtol=TOL[dtype]["rtol"])
    # only the normed output used: the residual branch gets no extra gradient
    (gx,) = torch.autograd.grad(rmsnorm_residual(x, r, w, 1e-6)[0], (x,), gy)
    (gx_ref,) = torch.autograd.grad(rmsnorm_residual_reference(x, r, w, 1e-6)[0], (x,), gy)
    torch.testing.assert_close(gx, gx_ref, **TOL[dtype])


def test_rmsnorm_gradcheck_fp64():
    x = torch.randn(5, 7, dtype=torch.float64, device=DEVICE, requires_grad=True)
    r = torch.randn(5, 7, dtype=torch.float64, device=DEVICE, requires_grad=True)
    w = torch.randn(7, dtype=torch.float64, device=DEVICE, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: rmsnorm(x, w, 1e-5), (x, w), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, r, w: rmsnorm_residual(x, r, w, 1e-5), (x, r, w), fast_mode=True)


def test_dispatch_rmsnorm_backends_agree():
    x = torch.randn(6, 40, device=DEVICE)
    w = torch.randn(40, device=DEVICE)
    torch.testing.assert_close(dispatch.rms_norm(x, w, 1e-6, backend="triton"),
                               dispatch.rms_norm(x, w, 1e-6, backend="torch"))
    for a, b in zip(dispatch.rms_norm_residual(x, x, w, 1e-6, backend="triton"),
                    dispatch.rms_norm_residual(x, x, w, 1e-6, backend="torch")):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="model.kernels"):
        dispatch.rms_norm(x, w, 1e-6, backend="cuda")


@pytest.mark.skipif(DEVICE == "cuda", reason="checks the CPU-without-interpreter message")
def test_dispatch_forced_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        dispatch.rms_norm(x, torch.ones(8), 1e-6, backend="triton")


@pytest.mark.gpu
def test_rmsnorm_large_bf16_cuda():
    x = torch.randn(4096, 8192, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    w = torch.randn(8192, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    y, y_ref = rmsnorm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5)
    torch.testing.assert_close(y, y_ref, atol=2e-2, rtol=2e-2)
    g = torch.randn_like(y)
    a, b = _grads(y, (x, w), g), _grads(y_ref, (x, w), g)
    torch.testing.assert_close(a[0], b[0], atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(a[1].float(), b[1].float(), atol=2e-2 * b[1].abs().max().item(), rtol=2e-2)
