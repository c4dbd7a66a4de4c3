"""Packed documents: document ids and positions, document-masked attention kernels, the model's loss.

The outside reference is the per-document evaluation (tests/doc_helpers.py): each document of each
window run alone through the world-size-1 model, positions from 0. Masked attention over the packed
window must give the same loss (rel 1e-5). Edge cases: no EOS (a document longer than the window), one
token of a document at the end of the window, back-to-back EOS, EOS first.
"""
from __future__ import annotations

import pytest
import torch

from doc_helpers import doc_spans, per_document_loss_sum
from parallel3d.kernels import _flash_common, dispatch
from parallel3d.kernels.flash_attention import attention_reference, flash_attention
from parallel3d.kernels.varlen_attention import cu_seqlens, query_blocks, varlen_sdpa
from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Llama
from parallel3d.context_parallel import Documents, document_ids, document_positions
from parallel3d.mesh import ParallelContext
from parity import enlarge_weights

EOS = 3


def test_document_ids_and_positions():
    ids = torch.tensor([[5, 6, EOS, 7, 8, EOS, EOS, 9],     # EOS belongs to the document it ends
                        [5, 6, 7, 8, 9, 10, 11, 12],        # no EOS: one document (longer than the window)
                        [EOS, EOS, EOS, 5, 6, 7, 8, EOS]])  # back-to-back EOS, EOS first and last
    doc = document_ids(ids, EOS)
    assert doc.tolist() == [[0, 0, 0, 1, 1, 1, 2, 3], [0] * 8, [0, 1, 2, 3, 3, 3, 3, 3]]
    assert document_positions(doc).tolist() == [[0, 1, 2, 0, 1, 2, 0, 0], list(range(8)), [0, 0, 0, 0, 1, 2, 3, 4]]
    assert doc_spans(ids[0], EOS) == [(0, 3), (3, 6), (6, 7), (7, 8)]
    cu, longest = cu_seqlens(doc)
    assert cu.tolist() == [0, 3, 6, 7, 8, 16, 17, 18, 19, 24] and longest == 8


def _docs(b: int, s: int, p: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    eos = (torch.rand(b, s, generator=g) < p).long()
    return torch.cumsum(eos, 1) - eos  # (b, s)


@pytest.mark.parametrize("tma,key_rows", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_varlen_kernel_matches_reference(monkeypatch, causal, tma, key_rows):
    """Forward (out, lse) and backward of the Triton kernel with document ids, odd lengths, GQA,
    q/k of different lengths and id ranges (ring blocks), against the dense masked reference; with the
    pointer loads, with the tensor-descriptor (TMA) loads, and with dK/dV's key-rows form."""
    monkeypatch.setattr(_flash_common, "INTERPRETER_TMA", tma)
    monkeypatch.setattr(_flash_common, "INTERPRETER_KEY_ROWS", key_rows)
    torch.manual_seed(0)
    b, s, hq, hk, d = 1, 37, 2, 1, 8
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64, requires_grad=True) for h in (hq, hk, hk))
    doc = _docs(b, s, 0.12, 1)
    for qs, ks in ((slice(0, s), slice(0, s)), (slice(17, 37), slice(0, 25))):
        check_documents_against_reference(q, k, v, doc, qs, ks, causal)


def check_documents_against_reference(q, k, v, doc, qs: slice, ks: slice, causal: bool) -> None:
    """The Triton kernel's out, lse and gradients (through both) on q[:, qs] against k, v[:, ks] with document
    ids `doc`, against the dense masked reference (fp64 inputs: default tolerances)."""
    args = (q[:, qs], k[:, ks], v[:, ks], causal)
    out, lse = flash_attention(*args, q_doc=doc[:, qs], k_doc=doc[:, ks])
    ref, ref_lse = attention_reference(*args, q_doc=doc[:, qs], k_doc=doc[:, ks])
    torch.testing.assert_close(out, ref)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))  # rows seeing no key of their document: -inf
    torch.testing.assert_close(lse[finite], ref_lse[finite])
    g = torch.randn_like(out)
    got = torch.autograd.grad((out * g).sum() + lse[finite].sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum() + ref_lse[finite].sum(), (q, k, v))
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e)


def test_blockwise_sdpa_matches_reference():
    """The torch path: query blocks of 8 rows, each against keys from its earliest document's start."""
    torch.manual_seed(0)
    b, s, hq, hk, d = 2, 40, 4, 2, 8
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64, requires_grad=True) for h in (hq, hk, hk))
    doc = _docs(b, s, 0.2, 2)
    blocks = query_blocks(doc, 8)
    assert any(k0 > 0 for _, _, k0 in blocks)  # some block skips keys no row of it can see
    out = varlen_sdpa(q, k, v, doc, blocks)
    ref, _ = attention_reference(q, k, v, True, q_doc=doc)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    for a, e in zip(torch.autograd.grad((out * g).sum(), (q, k, v)), torch.autograd.grad((ref * g).sum(), (q, k, v))):
        torch.testing.assert_close(a, e)
    torch.testing.assert_close(dispatch.attention(q, k, v, backend="torch", doc_ids=doc), ref)


def _model(kernels: str) -> Llama:
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=64, max_seq_len=32, kernels=kernels)
    model = Llama(cfg, ParallelContext.single())
    torch.manual_seed(7)
    return enlarge_weights(model)  # attention far from uniform: crossing documents changes the loss


EDGE_WINDOWS = {
    "no-eos": [10 + i % 40 for i in range(17)],                 # one document longer than the window
    "one-token-tail": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, EOS, 40, 41],  # 40 alone
    "back-to-back": [11, 12, EOS, EOS, EOS, 13, 14, 15, EOS, 16, 17, 18, 19, 20, EOS, EOS, 21],
    "eos-first": [EOS, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26],
}


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_model_loss_equals_each_document_alone(kernels):
    """Masked attention + restarted positions over the packed window == every document alone."""
    reference = _model("torch")
    model = _model(kernels)
    model.load_state_dict(reference.state_dict())
    windows = torch.tensor(list(EDGE_WINDOWS.values()))  # (4, 17): 16 inputs + the shifted targets
    ids, labels = windows[:, :-1], windows[:, 1:]
    doc = document_ids(ids, EOS)
    with torch.no_grad():
        got = float(model(ids, document_positions(doc), labels, documents=Documents.from_host(doc)))
        plain = float(reference(ids, torch.arange(16), labels))
    want, count = per_document_loss_sum(reference, windows, EOS)  # torch kernels: the reference
    assert count == ids.numel()  # every target counts
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert abs(plain - want) > 1e-2 * abs(want), "the windows must cross documents for the test to mean something"
