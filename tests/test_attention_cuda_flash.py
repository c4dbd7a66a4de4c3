"""Context-parallel attention blocks on CUDA through SDPA's own ops, cuDNN's on Hopper
(aten._scaled_dot_product_cudnn_attention) and FlashAttention-2's (aten._scaled_dot_product_flash_attention)
where cuDNN's is off or cannot run: each returns the lse and its backward takes the merged (out, lse), which
is what ring attention needs (kernels/attention_cuda.py, cuda_lse_op). Each case against the exact fp64
reference: out, lse and gradients; a causal block with more keys than queries (bottom-right, run as one
band); GQA; and the backward of two key blocks from their merged (out, lse) adding up to the full gradient
(what the ring does).
GPU only: on the CPU the same functions take aten's CPU flash op (tests/test_attention_backend.py)."""
from __future__ import annotations

import pytest
import torch

from parallel3d.context_parallel.blocks import block_backward, block_forward, merge_into
from parallel3d.kernels import dispatch
from parallel3d.kernels.attention_backend import cuda_lse_op, select_attention
from parallel3d.kernels.flash_attention import attention_reference

pytestmark = pytest.mark.gpu
TOL = dict(rtol=3e-2, atol=3e-2)      # 16-bit inputs against fp64
LSE_TOL = dict(rtol=2e-3, atol=2e-3)  # fp32 lse of 16-bit q k^T


def _qkv(sq, sk, hq, hk, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(2, s, h, d, generator=gen, device="cuda", dtype=torch.float64).to(dtype).requires_grad_()
            for s, h in ((sq, hq), (sk, hk), (sk, hk))]


def _grads(out, inputs, do):
    return torch.autograd.grad(out, inputs, do.to(out.dtype))


@pytest.fixture(params=["cudnn", "flash"])
def lse_op(request):
    """Each of SDPA's ops: FlashAttention-2's with cuDNN's switched off (as a run on an A100 takes it)."""
    enabled = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(request.param == "cudnn")
    yield request.param
    torch.backends.cuda.enable_cudnn_sdp(enabled)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sq,sk,causal,hq,hk,d", [(256, 256, True, 8, 2, 64), (200, 333, True, 8, 2, 128),
                                                  (96, 96, True, 4, 4, 128), (100, 260, False, 8, 1, 64),
                                                  (64, 64, True, 4, 2, 256)])
def test_cuda_blocks_take_sdpa_ops_and_match_fp64(sq, sk, causal, hq, hk, d, dtype, lse_op):
    q, k, v = _qkv(sq, sk, hq, hk, d, dtype)
    assert select_attention("auto", q, need_lse=True) == "sdpa"
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert cuda_lse_op(q) == ("cudnn" if lse_op == "cudnn" and hopper and d <= 128 else "flash")
    out, lse = dispatch.attention_with_lse(q, k, v, causal, None, "auto")  # (b, sq, hq, d), (b, hq, sq)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, causal)
    torch.testing.assert_close(out.double(), ref, **TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOL)
    do = torch.randn_like(ref)
    for got, want in zip(_grads(out, (q, k, v), do), torch.autograd.grad(ref, (q64, k64, v64), do)):
        torch.testing.assert_close(got.double(), want, **TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_blocks_merge_and_backward_from_the_merged_lse(dtype, lse_op):
    """Queries against two key blocks (all visible, then a bottom-right causal one), merged through their lse,
    equal the whole attention; each block's backward from the merged (out, lse) sums to its gradient."""
    q, k, v = _qkv(192, 448, 8, 2, 128, dtype, seed=1)
    scale = 128 ** -0.5
    out, lse = block_forward(q, k[:, :256], v[:, :256], False, scale, "auto")  # keys every query sees
    out = out.float()
    o2, l2 = block_forward(q, k[:, 256:], v[:, 256:], True, scale, "auto")   # the causal square
    merge_into(out, lse, o2, l2)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, True)
    torch.testing.assert_close(out.double(), ref, **TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOL)
    do = torch.randn_like(ref)
    first = block_backward(do.to(dtype), q, k[:, :256], v[:, :256], out, lse, False, scale, "auto")
    second = block_backward(do.to(dtype), q, k[:, 256:], v[:, 256:], out, lse, True, scale, "auto")
    got = (first[0] + second[0], torch.cat([first[1], second[1]], 1), torch.cat([first[2], second[2]], 1))
    for a, b in zip(got, torch.autograd.grad(ref, (q64, k64, v64), do)):
        torch.testing.assert_close(a.double(), b, **TOL)


def test_cuda_blocks_with_documents_keep_our_kernel():
    """SDPA's flash op masks no documents: a block with document ids takes the Triton kernel's masking."""
    q, k, v = _qkv(128, 128, 4, 2, 64, torch.bfloat16, seed=2)
    doc = torch.tensor([0] * 50 + [1] * 78, device="cuda").expand(2, 128)
    out, lse = dispatch.attention_with_lse(q, k, v, True, None, "auto", doc, doc)
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, True, q_doc=doc, k_doc=doc)
    torch.testing.assert_close(out.double(), ref, **TOL)
    torch.testing.assert_close(lse.double(), ref_lse, **LSE_TOL)
