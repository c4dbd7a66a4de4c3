"""RoPE Triton kernel vs torch reference (TRITON_INTERPRET=1 on CPU, see conftest).

Tolerances: fp32 atol=rtol=1e-5 (the kernel does the same fp32 arithmetic); bf16 atol=rtol=2e-2 (one
ulp, the interpreter truncates on the final fp32->bf16 cast); gradcheck in fp64 (fast mode).
"""
import pytest
import torch

from parallel3d.kernels import dispatch
from parallel3d.kernels.rope import rope, rope_cos_sin, rope_inv_freq, rope_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def _check(q, k, cos, sin, dtype):
    out, ref = rope(q, k, cos, sin), rope_reference(q, k, cos, sin)
    for a, b in zip(out, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **TOL[dtype])
    grads = [torch.randn_like(t) for t in out]
    for a, b in zip(torch.autograd.grad(out, (q, k), grads), torch.autograd.grad(ref, (q, k), grads)):
        torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_shared_positions_strided_qk(dtype):
    """q and k are strided views of one fused qkv projection; positions offset like a CP shard."""
    torch.manual_seed(0)
    b, s, hq, hk, d = 2, 11, 5, 3, 24
    inv = rope_inv_freq(d, 500000.0, LLAMA3)
    cos, sin = rope_cos_sin(torch.arange(40, 40 + s, device=DEVICE), inv)  # (s, d)
    qkv = torch.randn(b, s, hq + 2 * hk, d, dtype=dtype, device=DEVICE)
    q = qkv[:, :, :hq].requires_grad_()
    k = qkv[:, :, hq:hq + hk].detach().requires_grad_()
    _check(q, k, cos, sin, dtype)


def test_rope_per_batch_positions_and_uneven_halves():
    """(b, s, d) cos/sin with arbitrary positions, and halves that differ (general cos/sin tables)."""
    torch.manual_seed(1)
    b, s, h, d = 2, 7, 4, 10
    cos, sin = rope_cos_sin(torch.randint(0, 1000, (b, s), device=DEVICE), rope_inv_freq(d, 10000.0))
    cos, sin = cos * torch.linspace(0.5, 1.5, d, device=DEVICE), sin.flip(-1)
    q = torch.randn(b, s, h, d, device=DEVICE, requires_grad=True)
    k = torch.randn(b, s, 1, d, device=DEVICE, requires_grad=True)
    _check(q, k, cos, sin, torch.float32)


@pytest.mark.parametrize("tokens", [2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_several_tokens_per_program_ragged_tail(tokens, dtype):
    """Several tokens per program with a token count that leaves a ragged last program (b*s = 3*7 = 21), odd
    head counts, per-batch positions, a strided q; forward and the backward kernel (the transposed rotation)
    against the reference and its autograd."""
    from parallel3d.kernels.rope import rope_apply
    torch.manual_seed(tokens)
    b, s, hq, hk, d = 3, 7, 5, 3, 12
    qkv = torch.randn(b, s, hq + 2 * hk, d, device=DEVICE).to(dtype)
    q, k = qkv[:, :, :hq], qkv[:, :, hq:hq + hk]
    cos, sin = rope_cos_sin(torch.randint(0, 50, (b, s), device=DEVICE), rope_inv_freq(d, 10000.0))
    for a, r in zip(rope_apply(q, k, cos, sin, tokens_per_program=tokens), rope_reference(q, k, cos, sin)):
        torch.testing.assert_close(a, r, **TOL[dtype])
    qr, kr = q.float().requires_grad_(), k.float().requires_grad_()
    dq, dk = torch.randn(b, s, hq, d, device=DEVICE).to(dtype), torch.randn(b, s, hk, d, device=DEVICE).to(dtype)
    ref = torch.autograd.grad(rope_reference(qr, kr, cos, sin), (qr, kr), (dq.float(), dk.float()))
    for a, r in zip(rope_apply(dq, dk, cos, sin, backward=True, tokens_per_program=tokens), ref):
        torch.testing.assert_close(a.float(), r, **TOL[dtype])


def test_rope_gradcheck_fp64():
    q = torch.randn(1, 3, 2, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    k = torch.randn(1, 3, 1, 8, dtype=torch.float64, device=DEVICE, requires_grad=True)
    cos, sin = rope_cos_sin(torch.arange(3, device=DEVICE), rope_inv_freq(8, 10000.0))
    cos, sin = cos.double(), sin.double()
    assert torch.autograd.gradcheck(lambda q, k: rope(q, k, cos, sin), (q, k), fast_mode=True)


def test_rope_inv_freq_llama3_scaling_properties():
    d, theta = 64, 500000.0
    base, scaled = rope_inv_freq(d, theta), rope_inv_freq(d, theta, LLAMA3)
    wavelen = 2 * torch.pi / base.double()
    high = wavelen < LLAMA3["original_max_position_embeddings"] / LLAMA3["high_freq_factor"]
    low = wavelen > LLAMA3["original_max_position_embeddings"] / LLAMA3["low_freq_factor"]
    torch.testing.assert_close(scaled[high], base[high])  # short wavelengths untouched
    torch.testing.assert_close(scaled[low], base[low] / LLAMA3["factor"])  # long ones divided by factor
    assert ((scaled <= base + 1e-12) & (scaled >= base / LLAMA3["factor"] - 1e-12)).all()


def test_dispatch_rope_backends_agree():
    q = torch.randn(1, 5, 2, 8, device=DEVICE)
    k = torch.randn(1, 5, 2, 8, device=DEVICE)
    cos, sin = rope_cos_sin(torch.arange(5, device=DEVICE), rope_inv_freq(8, 10000.0))
    for a, b in zip(dispatch.rope(q, k, cos, sin, backend="triton"), dispatch.rope(q, k, cos, sin, "torch")):
        torch.testing.assert_close(a, b)


@pytest.mark.gpu
def test_rope_large_bf16_cuda():
    b, s, hq, hk, d = 2, 4096, 32, 8, 128
    cos, sin = rope_cos_sin(torch.arange(s, device="cuda"), rope_inv_freq(d, 500000.0, LLAMA3))
    q = torch.randn(b, s, hq, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    k = torch.randn(b, s, hk, d, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    _check(q, k, cos, sin, torch.bfloat16)
