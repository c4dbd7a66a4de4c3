"""Flash attention Triton kernels vs `attention_reference` (TRITON_INTERPRET=1 on CPU, see conftest).

Shapes are odd on purpose: lengths not multiples of the (16 under the interpreter) block, sq != sk with
bottom-right causal alignment (including rows that see no key), GQA, head dims not powers of two.
Tolerances: fp32 atol=rtol=1e-4 (blockwise online softmax vs one logsumexp); fp16 3e-3; bf16 3e-2
(outputs/grads rounded to bf16, the interpreter truncates); lse always fp32 1e-4; gradcheck fp64.
"""
import pytest
import torch

from parallel3d.kernels import _flash_common, dispatch
from parallel3d.kernels.flash_attention import attention_reference, flash_attention, flash_attention_backward, \
    flash_attention_forward

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=3e-3),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def _qkv(b, sq, sk, hq, hk, d, dtype, seed=0):
    torch.manual_seed(seed)
    make = lambda s, h: torch.randn(b, s, h, d, device=DEVICE).to(dtype).requires_grad_()  # noqa: E731
    return make(sq, hq), make(sk, hk), make(sk, hk)


def _compare(q, k, v, causal, lse_grad=False):
    dtype = q.dtype
    out, lse = flash_attention(q, k, v, causal)
    out_ref, lse_ref = attention_reference(q, k, v, causal)
    assert out.shape == out_ref.shape and out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out, out_ref, **TOL[dtype])
    torch.testing.assert_close(lse, lse_ref, atol=1e-4, rtol=1e-4)  # equal -inf rows compare equal
    finite = torch.isfinite(lse_ref)
    g_out = torch.randn_like(out)
    g_lse = torch.where(finite, torch.randn_like(lse_ref), torch.zeros_like(lse_ref))

    def objective(o, l):
        total = (o.float() * g_out.float()).sum()
        return total + (torch.where(finite, l, torch.zeros_like(l)) * g_lse).sum() if lse_grad else total

    grads = torch.autograd.grad(objective(out, lse), (q, k, v))
    grads_ref = torch.autograd.grad(objective(out_ref, lse_ref), (q, k, v))
    for a, b in zip(grads, grads_ref):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, atol=TOL[dtype]["atol"] * max(1.0, b.abs().max().item()),
                                   rtol=TOL[dtype]["rtol"])


@pytest.mark.parametrize("b,sq,sk,hq,hk,d,causal", [
    (1, 37, 37, 4, 2, 32, True),    # self-attention, GQA 2, ragged last block
    (2, 19, 45, 2, 1, 16, True),    # more keys than queries (a CP block / KV cache)
    (1, 45, 19, 2, 2, 16, True),    # fewer keys: the first 26 query rows see nothing
    (1, 33, 21, 3, 1, 24, False),   # non-causal, MQA, head dim not a power of two
    (1, 20, 20, 1, 1, 128, True),   # head dim 128
])
def test_flash_attention_fp32(b, sq, sk, hq, hk, d, causal):
    _compare(*_qkv(b, sq, sk, hq, hk, d, torch.float32), causal)


def test_flash_attention_lse_is_differentiable():
    _compare(*_qkv(1, 45, 19, 2, 1, 16, torch.float32, seed=1), True, lse_grad=True)
    _compare(*_qkv(1, 17, 30, 2, 2, 16, torch.float32, seed=2), False, lse_grad=True)


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 32), (torch.float16, 64)])
def test_flash_attention_half_precision(dtype, d):
    _compare(*_qkv(1, 37, 37, 4, 2, d, dtype, seed=3), True)


def test_flash_attention_gradcheck_fp64():
    q, k, v = (t.detach().double().requires_grad_() for t in _qkv(1, 5, 7, 2, 1, 4, torch.float32, seed=4))
    assert torch.autograd.gradcheck(lambda q, k, v: flash_attention(q, k, v, True)[0], (q, k, v),
                                    fast_mode=True)


LOADS = [(True, False), (False, True), (True, True)]   # (TMA descriptor loads, dK/dV's key-rows form)


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter's switches; on a GPU: ..._tma_and_key_rows_on_hopper")
@pytest.mark.parametrize("tma,key_rows", LOADS)
@pytest.mark.parametrize("b,sq,sk,hq,hk,d,causal,dtype", [
    (1, 37, 37, 4, 2, 32, True, torch.float32),    # ragged last block: the boxes' rows past the sequence
    (2, 19, 45, 2, 1, 16, True, torch.float32),    # more keys than queries, two batches
    (1, 45, 19, 2, 2, 16, True, torch.float32),    # rows that see no key
    (1, 33, 21, 3, 1, 24, False, torch.float32),   # head dim 24 in boxes of 32 columns
    (1, 37, 37, 4, 2, 32, True, torch.bfloat16),
])
def test_flash_attention_tma_loads_and_key_rows(monkeypatch, b, sq, sk, hq, hk, d, causal, dtype, tma, key_rows):
    """The tensor-descriptor loads (TMA_16BIT's rows on sm_90) and dK/dV's key-rows form (KEY_ROWS_16BIT's)
    under the interpreter: the boxes' zero fill past the sequence and the head dim stands in for the pointer
    loads' masks, the transposed products and masks give the same gradients; lse and its gradient too."""
    monkeypatch.setattr(_flash_common, "INTERPRETER_TMA", tma)
    monkeypatch.setattr(_flash_common, "INTERPRETER_KEY_ROWS", key_rows)
    q, k, v = _qkv(b, sq, sk, hq, hk, d, dtype, seed=8)
    assert all(_flash_common.use_tma(kernel, d, q.device, q, k, v) == tma for kernel in ("fwd", "dkdv", "dq"))
    assert _flash_common.key_rows_form(d, dtype, q.device) == key_rows
    _compare(q, k, v, causal, lse_grad=dtype == torch.float32)


def test_a_scale_that_is_not_positive_is_refused():
    """The forward scales the row max of the unscaled logits (max(c s) = c max(s) only for c > 0)."""
    q, k, v = (t.detach() for t in _qkv(1, 8, 8, 2, 1, 16, torch.float32, seed=12))
    for scale in (0.0, -0.25):
        with pytest.raises(ValueError, match="attention scale must be positive"):
            flash_attention(q, k, v, True, scale)


def test_tma_falls_back_to_pointers_off_its_layout(monkeypatch):
    """TMA needs 16-byte aligned base and strides: a head dim of 6 fp32 (24-byte rows) or a view starting
    off a 16-byte boundary takes the pointer loads, and the op stays exact."""
    monkeypatch.setattr(_flash_common, "INTERPRETER_TMA", True)
    q, k, v = _qkv(1, 21, 21, 2, 1, 6, torch.float32, seed=9)
    assert not _flash_common.use_tma("fwd", 6, q.device, q, k, v)
    _compare(q, k, v, True)
    q, k, v = _qkv(1, 22, 22, 2, 1, 16, torch.float32, seed=10)
    shifted = torch.randn(1 * 22 * 2 * 16 + 1)[1:].view(1, 22, 2, 16)  # base 4 bytes past an aligned one
    assert not _flash_common.use_tma("fwd", 16, q.device, shifted, k, v)
    torch.testing.assert_close(flash_attention(shifted, k, v, True)[0], attention_reference(shifted, k, v, True)[0],
                               atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tma,key_rows", [(False, False)] + LOADS)
def test_flash_attention_backward_with_merged_out_and_lse(monkeypatch, tma, key_rows):
    """Ring-attention use: two key blocks, outputs merged via lse; each block's backward takes the merged
    (global) out and lse and the pieces add up to the full gradient (pointer and TMA loads, both dK/dV forms)."""
    monkeypatch.setattr(_flash_common, "INTERPRETER_TMA", tma)
    monkeypatch.setattr(_flash_common, "INTERPRETER_KEY_ROWS", key_rows)
    q, k, v = _qkv(1, 21, 34, 2, 1, 16, torch.float32, seed=5)
    split = 18
    blocks = (slice(0, split), slice(split, 34))
    parts = [flash_attention_forward(q, k[:, sl], v[:, sl], False) for sl in blocks]
    lse = torch.logaddexp(parts[0][1], parts[1][1])  # (b, hq, sq)
    out = sum(torch.exp(l_i - lse).transpose(1, 2)[..., None] * o_i for o_i, l_i in parts)  # (b, sq, hq, d)
    out_ref, lse_ref = attention_reference(q, k, v, False)
    torch.testing.assert_close(out, out_ref, atol=1e-4, rtol=1e-4)
    do = torch.randn_like(out)
    dq, dk, dv = torch.zeros_like(q), [], []
    for sl in blocks:
        dq_i, dk_i, dv_i = flash_attention_backward(do, q, k[:, sl], v[:, sl], out, lse, False, None)
        dq, dk, dv = dq + dq_i, dk + [dk_i], dv + [dv_i]
    ref = torch.autograd.grad(out_ref, (q, k, v), do)
    for a, b in zip((dq, torch.cat(dk, 1), torch.cat(dv, 1)), ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_dispatch_attention_backends_agree():
    q, k, v = (t.detach() for t in _qkv(1, 24, 24, 4, 2, 16, torch.float32, seed=6))
    torch.testing.assert_close(dispatch.attention(q, k, v, True, backend="triton"),
                               dispatch.attention(q, k, v, True, backend="torch"), atol=1e-4, rtol=1e-4)
    for a, b in zip(dispatch.attention_with_lse(q, k, v, False, 0.3, backend="triton"),
                    dispatch.attention_with_lse(q, k, v, False, 0.3, backend="torch")):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attention_large_bf16_cuda(d, causal):
    q, k, v = _qkv(2, 1000, 1000, 16, 4, d, torch.bfloat16, seed=7)
    _compare(q, k, v, causal)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("key_rows", [False, True])
def test_flash_attention_tma_and_key_rows_on_hopper(monkeypatch, d, key_rows):
    """The prepared sm_90 paths on the hardware (the interpreter emulates TMA; this runs it): every kernel
    loading through tensor descriptors, dK/dV in either form, at a ragged length, GQA, and with documents."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA tensor descriptors need sm_90")
    monkeypatch.setattr(_flash_common, "TMA_16BIT", frozenset((k, c) for k in ("fwd", "dkdv", "dq") for c in (64, 128)))
    monkeypatch.setattr(_flash_common, "KEY_ROWS_16BIT", frozenset({(90, 64), (90, 128)} if key_rows else ()))
    q, k, v = _qkv(2, 1000, 1000, 16, 4, d, torch.bfloat16, seed=11)
    assert _flash_common.use_tma("fwd", d, q.device, q, k, v)
    _compare(q, k, v, True)
    doc = (torch.arange(1000, device=q.device) // 300).repeat(2, 1)  # (2, 1000): documents of 300 tokens
    out, _ = flash_attention(q, k, v, True, q_doc=doc, k_doc=doc)
    ref, _ = attention_reference(q, k, v, True, q_doc=doc, k_doc=doc)
    torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])
