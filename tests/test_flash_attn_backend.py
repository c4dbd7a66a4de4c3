"""model.attention=flash_attn without a GPU: the flash-attn package has no CPU wheel, so these tests install
the stand-in of tests/flash_attn_standin.py (the package's documented API on exact torch math) as
`flash_attn` and stand a CPU tensor in for a CUDA one by patching the selector's one device question
(kernels.attention_backend.on_gpu). They check the stand-in against the package's documentation, the
selection rules (device, dtype, head dim, installed, lse needed), our calls (plain and varlen) against the
exact fp64 reference, the model through the Trainer against model.attention=sdpa, and that a layout mistake
in our call fails the comparison. The last test runs the real package on a GPU (skipped elsewhere).
"""
from __future__ import annotations

import sys

import pytest
import torch

import flash_attn_standin as standin
from parallel3d.kernels import attention_backend, dispatch
from parallel3d.kernels.attention_backend import select_attention
from parallel3d.kernels.flash_attention import attention_reference

BF16 = dict(rtol=3e-2, atol=3e-2)


@pytest.fixture
def fake_gpu(monkeypatch):
    """The stand-in installed as flash_attn, and CPU tensors taken for CUDA ones by the selector."""
    standin.install(monkeypatch)
    monkeypatch.setattr(attention_backend, "on_gpu", lambda q: True)


def _qkv(s=24, hq=6, hk=2, d=16, dtype=torch.bfloat16, b=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, d, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
            for h in (hq, hk, hk)]


def test_standin_follows_the_documented_contract():
    """The examples of flash_attn_interface.py's docstrings: bottom-right causal masks, the GQA head groups,
    the lse shapes, fp16/bf16 only."""
    q, k, v = (torch.randn(1, s, 6, 8, dtype=torch.bfloat16) for s in (2, 5, 5))
    _, lse, probs = standin.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert lse.dtype == torch.float32 and lse.shape == (1, 6, 2)
    assert (probs[0, 0] != 0).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]  # seqlen_q=2, seqlen_k=5
    q, k, v = (torch.randn(1, s, 6, 8, dtype=torch.bfloat16) for s in (5, 2, 2))
    out = standin.flash_attn_func(q, k, v, causal=True)
    assert out[0, :3].abs().max() == 0 and out[0, 3:].abs().amax(-1).min() > 0  # rows seeing no key give zeros
    # "if Q has 6 heads and K, V have 2 heads, head 0, 1, 2 of Q will attention to head 0 of K, V"
    v = torch.ones(1, 2, 2, 8, dtype=torch.bfloat16) * torch.tensor([1.0, 2.0], dtype=torch.bfloat16)[:, None]
    k = torch.randn(1, 2, 2, 8, dtype=torch.bfloat16)
    out = standin.flash_attn_func(torch.randn(1, 2, 6, 8, dtype=torch.bfloat16), k, v)
    assert out[0, :, :, 0].tolist() == [[1.0, 1.0, 1.0, 2.0, 2.0, 2.0]] * 2
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    qv, kv = torch.randn(7, 6, 8, dtype=torch.bfloat16), torch.randn(7, 2, 8, dtype=torch.bfloat16)
    _, lse, _ = standin.flash_attn_varlen_func(qv, kv, kv, cu, cu, 4, 4, causal=True, return_attn_probs=True)
    assert lse.shape == (6, 7)  # (nheads, total_q)
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        standin.flash_attn_func(q.float(), k.float(), v.float())
    with pytest.raises(RuntimeError, match="max_seqlen_q=3"):
        standin.flash_attn_varlen_func(qv, kv, kv, cu, cu, 3, 4)


def test_selection_rules(monkeypatch):
    """auto: CPU -> sdpa; CUDA -> flash_attn when installed, 16-bit, head dim <= 256 and no lse needed; with
    the lse (CP blocks) SDPA's CUDA flash op where it runs (16-bit, head dim <= 256), else the Triton kernel.
    Explicit flash_attn: refused with the reason."""
    bf16, f32 = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16), torch.zeros(1, 8, 2, 64)
    wide = torch.zeros(1, 8, 2, 512, dtype=torch.bfloat16)
    assert select_attention("auto", bf16, need_lse=False) == "sdpa"  # CPU, package or not
    with pytest.raises(ValueError, match="not installed"):
        select_attention("flash_attn", bf16, need_lse=False)
    standin.install(monkeypatch)
    assert select_attention("auto", bf16, need_lse=False) == "sdpa"
    with pytest.raises(ValueError, match="CUDA devices only"):
        select_attention("flash_attn", bf16, need_lse=False)
    monkeypatch.setattr(attention_backend, "on_gpu", lambda q: True)
    assert select_attention("auto", bf16, need_lse=False) == "flash_attn"
    assert select_attention("auto", bf16, need_lse=True) == "sdpa"  # CP blocks need the lse: SDPA's flash op
    assert select_attention("auto", bf16, need_lse=True, documents=True) == "triton"  # which masks no documents
    assert select_attention("auto", f32, need_lse=True) == "triton"  # which takes 16 bits only
    assert select_attention("auto", wide, need_lse=True) == "triton"  # and head dims up to 256
    assert select_attention("auto", f32, need_lse=False) == "sdpa"   # SDPA's CUDA kernels beat our Triton one
    assert select_attention("auto", wide, need_lse=False) == "sdpa"
    assert select_attention("flash_attn", bf16, need_lse=False) == "flash_attn"
    assert select_attention("flash_attn", bf16, need_lse=True) == "sdpa"
    assert select_attention("sdpa", bf16, need_lse=True) == "sdpa"
    assert select_attention("triton", bf16, need_lse=True) == "triton"
    with pytest.raises(ValueError, match="fp16/bf16 activations only"):
        select_attention("flash_attn", f32, need_lse=False)
    with pytest.raises(ValueError, match="head dims up to 256"):
        select_attention("flash_attn", wide, need_lse=False)
    monkeypatch.delitem(sys.modules, "flash_attn")
    assert select_attention("auto", bf16, need_lse=False) == "sdpa"  # on CUDA without the package


def _check_against_reference(q, k, v, backend, doc=None):
    out = dispatch.attention(q, k, v, True, None, backend, doc_ids=doc)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = attention_reference(q64, k64, v64, True, q_doc=doc, k_doc=doc)[0]
    torch.testing.assert_close(out.double(), ref, **BF16)
    do = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), do.to(out.dtype)),
                         torch.autograd.grad(ref, (q64, k64, v64), do)):
        torch.testing.assert_close(got.double(), want, **BF16)


@pytest.mark.parametrize("backend", ["flash_attn", "auto"])
def test_flash_attn_calls_match_the_reference(fake_gpu, backend):
    """GQA, causal, forward and backward; packed documents through flash_attn_varlen_func."""
    q, k, v = _qkv()
    _check_against_reference(q, k, v, backend)
    assert standin.CALLS == [("flash_attn_func", (2, 24, 6, 16))]
    doc = torch.tensor([[0] * 5 + [1] * 11 + [2] * 8, [0] * 24])  # (b, s)
    _check_against_reference(q, k, v, backend, doc)
    assert standin.CALLS[-1] == ("flash_attn_varlen_func", (48, 6, 16))


def test_a_layout_mistake_in_our_call_fails(fake_gpu, monkeypatch):
    """The check above is not vacuous: passing (b, h, s, d) where the package wants (b, s, h, d) fails it."""
    def transposed(q, k, v, causal, scale):
        return standin.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                       causal=causal).transpose(1, 2)
    monkeypatch.setattr(dispatch, "flash_attn_attention", transposed)
    with pytest.raises(AssertionError):
        _check_against_reference(*_qkv(hk=6), "flash_attn")  # MHA, so the shapes alone do not catch it


def _trainer(overrides):
    from test_trainer_regressions import run
    return run(None, ["train.seq_len=16", "train.global_batch_size=2", "train.precision=bf16", *overrides], 3)


def _assert_bf16_parity(got, ref):
    """bf16 runs of two correct backends: losses within 1e-4 (relative), weights within 4e-3 after three
    AdamW steps (sdpa vs the stand-in measured 1.3e-3 and sdpa vs Triton 3.9e-3; a layout mistake: 1.8e-2,
    loss off by 5e-3)."""
    for step, (g, e) in enumerate(zip(got["records"], ref["records"])):
        assert abs(g["loss"] - e["loss"]) <= 1e-4 * abs(e["loss"]), f"step {step}: {g['loss']} vs {e['loss']}"
    for name, (w, _, _) in ref["weights"].items():
        torch.testing.assert_close(got["weights"][name][0].float(), w.float(), rtol=0, atol=4e-3, msg=name)


def test_model_through_trainer_flash_attn_vs_sdpa(fake_gpu, monkeypatch):
    """The Llama model, config -> Trainer -> DistributedOptimizer, model.attention=flash_attn (every layer's
    attention through the stand-in) against model.attention=sdpa, bf16; the mutant with the layout mistake
    fails the same comparison."""
    ref = _trainer(["model.attention=sdpa"])
    assert not standin.CALLS
    got = _trainer(["model.attention=flash_attn"])
    assert len(standin.CALLS) >= 3 * 2  # every step, every layer
    _assert_bf16_parity(got, ref)

    def transposed(q, k, v, causal, scale):
        return standin.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                       causal=causal).transpose(1, 2)
    monkeypatch.setattr(dispatch, "flash_attn_attention", transposed)
    with pytest.raises(AssertionError):
        _assert_bf16_parity(_trainer(["model.attention=flash_attn"]), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("doc", [False, True])
def test_real_flash_attn_package_on_gpu(doc):
    """The installed flash-attn package on CUDA: plain and varlen calls against the fp64 reference."""
    pytest.importorskip("flash_attn")
    q, k, v = (t.detach().cuda().requires_grad_() for t in _qkv(s=64, hq=8, hk=2, d=64))
    ids = torch.tensor([[0] * 20 + [1] * 44, [0] * 64]).cuda() if doc else None
    assert select_attention("auto", q, need_lse=False) == "flash_attn"
    _check_against_reference(q, k, v, "flash_attn", ids)
