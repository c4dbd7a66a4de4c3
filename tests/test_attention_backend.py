"""model.attention: the backend selector, every available backend against the exact fp64 reference
(forward, backward, the lse the CP blocks merge), the block backward from a merged (out, lse), and the
model through the Trainer with each backend (world 1 and cp=2 ring)."""
from __future__ import annotations

import os

import pytest
import torch

from parallel3d.kernels import dispatch
from parallel3d.kernels.attention_backend import CAUSAL_BAND, select_attention
from parallel3d.kernels.flash_attention import attention_reference
from parallel3d.context_parallel.blocks import block_backward


def test_selector_on_this_cpu():
    f32, f64 = torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8, dtype=torch.float64)
    assert select_attention("auto", f32, need_lse=True) == "sdpa"
    assert select_attention("auto", f64, need_lse=True) == "reference"  # exact for tests
    assert select_attention("torch", f32, need_lse=True) == "sdpa"
    assert select_attention("sdpa", f32, need_lse=False) == "sdpa"
    if INTERPRETED:
        assert select_attention("triton", f32, need_lse=True) == "triton"  # TRITON_INTERPRET=1 (conftest)
    # the dry run's stand-in for CUDA takes the stand-in op of the kernel CUDA would run: a library's (SDPA /
    # flash-attn; with the lse SDPA's flash op) where it runs (16 bits, head dim <= 256), ours where asked for
    # or where the flash op cannot run
    meta = torch.zeros(1, 8, 2, 8, device="meta")
    assert select_attention("auto", meta, need_lse=True) == select_attention("flash_attn", meta, True) == "triton"
    bf16, wide = (torch.zeros(1, 8, 2, d, device="meta", dtype=torch.bfloat16) for d in (64, 512))
    assert select_attention("auto", bf16, need_lse=True) == select_attention("flash_attn", bf16, True) == "library"
    assert select_attention("auto", wide, need_lse=True) == "triton"
    assert select_attention("triton", bf16, need_lse=True) == "triton"
    assert select_attention("triton", meta, need_lse=False) == "triton"
    assert select_attention("torch", meta, need_lse=True) == "reference"   # as CUDA runs it: the scores kept
    for backend in ("auto", "torch", "flash_attn"):
        assert select_attention(backend, meta, need_lse=False) == "library", backend
    with pytest.raises(ValueError, match="flash_attn cannot run here: the flash-attn package is not installed"):
        select_attention("flash_attn", f32, need_lse=False)
    with pytest.raises(ValueError, match="attention backend must be one of"):
        select_attention("xformers", f32, need_lse=False)


def _qkv(sq, sk, hq=4, hk=2, d=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, s, h, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
            for s, h in ((sq, hq), (sk, hk), (sk, hk))]


# the Triton kernel on CPU tensors runs under the interpreter, which conftest sets only where CUDA is absent
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="the Triton kernel on CPU tensors needs "
                                       "TRITON_INTERPRET=1 (conftest sets it only without CUDA)")
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("sq,sk,causal", [(24, 24, True), (8, 24, True), (13, 29, False), (16, 40, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_with_lse_matches_fp64_reference(backend, sq, sk, causal, dtype):
    if backend == "triton" and dtype == torch.bfloat16 and sq != 24:
        pytest.skip("the interpreted Triton kernel is covered by test_kernels_flash_attention")
    if backend == "triton" and not INTERPRETED:
        pytest.skip("the Triton kernel on CPU tensors needs TRITON_INTERPRET=1 (conftest sets it only without CUDA)")
    q, k, v = _qkv(sq, sk, dtype=dtype)
    out, lse = dispatch.attention_with_lse(q, k, v, causal, None, backend)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, causal)
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    lse_tol = TOL[torch.float32] if dtype == torch.float32 else dict(rtol=1e-3, atol=1e-3)  # 16-bit q k^T
    torch.testing.assert_close(lse.double(), ref_lse, **lse_tol)
    do = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), do.to(dtype)), torch.autograd.grad(ref, (q64, k64, v64), do)):
        torch.testing.assert_close(a.double(), b, **TOL[dtype])


@pytest.mark.parametrize("sq,sk", [(300, 300), (200, 333), (CAUSAL_BAND + 1, CAUSAL_BAND + 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sdpa_causal_bands_match_fp64_reference(sq, sk, dtype):
    """Causal calls longer than a band run band by band (kernels.attention_backend.CAUSAL_BAND): out, lse and
    the backward from them match the exact reference, including a last band of one row."""
    assert sq > CAUSAL_BAND
    q, k, v = _qkv(sq, sk, dtype=dtype)
    out, lse = dispatch.attention_with_lse(q, k, v, True, None, "sdpa")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_reference(q64, k64, v64, True)
    tol = TOL[torch.float32] if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.double(), ref, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    do = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), do.to(dtype)), torch.autograd.grad(ref, (q64, k64, v64), do)):
        torch.testing.assert_close(a.double(), b, **tol)


@pytest.mark.parametrize("backend", ["sdpa", "torch", "auto"])
def test_plain_attention_backends(backend):
    q, k, v = _qkv(20, 20)
    ref = attention_reference(*(t.detach().double() for t in (q, k, v)), True)[0]
    torch.testing.assert_close(dispatch.attention(q, k, v, True, None, backend).double(), ref, rtol=2e-5, atol=2e-5)


def test_block_backward_from_merged_lse():
    """Two key blocks of one attention: each block's backward from the *merged* out/lse (what ring CP does)
    adds up to the full gradient, with the sdpa blocks as with the exact reference."""
    q, k, v = _qkv(16, 48, dtype=torch.float64)
    out, lse = attention_reference(q, k, v, True)
    do = torch.randn_like(out)
    full = torch.autograd.grad(out, (q, k, v), do)
    scale = 16 ** -0.5
    parts = {}
    for backend in ("sdpa", "reference"):
        first = block_backward(do, q, k[:, :20], v[:, :20], out, lse, False, scale, backend)  # keys all visible
        second = block_backward(do, q, k[:, 20:], v[:, 20:], out, lse, True, scale, backend)  # bottom-right
        parts[backend] = (first[0] + second[0], torch.cat([first[1], second[1]], 1),
                          torch.cat([first[2], second[2]], 1))
        for a, b in zip(parts[backend], full):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def _run(worker, overrides, steps):
    from test_trainer_regressions import run
    return run(worker, overrides, steps)


@needs_interpreter
def test_trainer_parity_across_backends():
    """The model through the Trainer: the Triton kernel (interpreted) gives the sdpa run's loss and weights
    (each is checked against the exact fp64 reference above; auto is sdpa on this CPU)."""
    from test_trainer_regressions import assert_parity, run
    small = ["train.seq_len=16", "train.global_batch_size=2"]
    ref = run(None, [*small, "model.attention=sdpa"], 2)
    assert_parity([run(None, [*small, "model.attention=triton"], 2)], ref)


def test_trainer_cp2_ring_sdpa_blocks(worlds):
    """cp=2 ring with the sdpa blocks (CPU default) == world size 1."""
    from test_trainer_regressions import assert_parity, run
    layout = ["parallel.cp=2", "parallel.cp_mode=ring", "model.attention=sdpa"]
    ref = run(None, layout[2:], 3)
    assert_parity(worlds.run(2, run, layout, 3), ref)


def test_library_attention_stand_in_is_our_kernels_op_under_its_own_name():
    """The meta stand-ins of SDPA's / flash-attn's kernel and of a CP block's op with the lse: our custom op's
    shapes, saved tensors and FLOPs (forward and backward) under their own names, and they refuse a real
    tensor."""
    from torch.utils.flop_counter import FlopCounterMode

    from parallel3d.kernels import ops
    from parallel3d.kernels.attention_standin import library_attention

    def run(fn, causal):
        q = torch.empty(2, 48, 4, 16, device="meta", requires_grad=True)   # (b, s, hq, d)
        k = torch.empty(2, 64, 2, 16, device="meta", requires_grad=True)   # (b, s, hk, d): GQA, sk > sq
        v = torch.empty(2, 64, 2, 16, device="meta", requires_grad=True)
        with FlopCounterMode(display=False) as counter:
            out, lse = fn(q, k, v, causal)
            out.backward(torch.empty_like(out))
        return out.shape, lse.shape, lse.dtype, q.grad.shape, k.grad.shape, counter.get_total_flops()

    for causal in (True, False):
        ours = run(lambda *a: ops.flash_attention(*a, None), causal)
        assert run(lambda *a: library_attention(*a, None), causal) == ours
        assert run(lambda *a: library_attention(*a, None, with_lse=True), causal) == ours
    assert dispatch.attention(*(torch.empty(1, 8, 2, 8, device="meta") for _ in range(3))).shape == (1, 8, 2, 8)
    with pytest.raises(RuntimeError, match="stand-in on the meta device"):
        library_attention(*(torch.zeros(1, 8, 2, 8) for _ in range(3)))
