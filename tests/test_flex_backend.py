"""model.attention=flex (kernels/flex_backend.py): torch's FlexAttention with a document-causal block mask.

On this CPU FlexAttention runs forward only (torch has no CPU backward), so these tests hold its forward
to the exact fp64 reference (packed documents, GQA, lengths off its 128-block grid, causal blocks with
sk > sq), the selector's rules, the mask built once per microbatch, the model's output against auto's,
and the one error a CPU training run gets. Its backward and speed are the GPU check's (gpu_check.sh flex).
"""
from __future__ import annotations

import pytest
import torch

from parallel3d.context_parallel.documents import Documents
from parallel3d.kernels import dispatch, flex_backend
from parallel3d.kernels.attention_backend import select_attention
from parallel3d.kernels.flash_attention import attention_reference


def _qkv(sq, sk, hq, hk, d=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, s, h, d, generator=gen, dtype=torch.float64).to(dtype)
            for s, h in ((sq, hq), (sk, hk), (sk, hk))]


def _documents(b, s, lengths):
    """(b, s) nondecreasing ids: row r cut into documents of the given lengths (rotated per row)."""
    rows = []
    for r in range(b):
        ids, doc, i = [], 0, r
        while len(ids) < s:
            ids += [doc] * lengths[i % len(lengths)]
            doc, i = doc + 1, i + 1
        rows.append(ids[:s])
    return Documents.from_host(torch.tensor(rows))


@pytest.mark.parametrize("s,hq,hk", [(200, 4, 2), (128, 4, 4), (77, 8, 2)])
def test_documents_match_the_fp64_reference(s, hq, hk):
    q, k, v = _qkv(s, s, hq, hk)
    docs = _documents(2, s, [50, 13, 1, 90])
    with torch.no_grad():
        out = dispatch.attention(q, k, v, causal=True, backend="flex", doc_ids=docs.ids, doc_ids_host=docs.host,
                                 doc_derived=docs.derived)  # (b, s, hq, d)
    ref = attention_reference(*(t.double() for t in (q, k, v)), True, None, q_doc=docs.ids, k_doc=docs.ids)[0]
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("sq,sk,causal", [(96, 96, True), (40, 200, True), (33, 70, False)])
def test_plain_attention_matches_the_fp64_reference(sq, sk, causal):
    """Causal blocks are bottom-right aligned (sk >= sq), as every other backend aligns them."""
    q, k, v = _qkv(sq, sk, 4, 2)
    with torch.no_grad():
        out = dispatch.attention(q, k, v, causal=causal, backend="flex", scale=0.3)
    ref = attention_reference(*(t.double() for t in (q, k, v)), causal, 0.3)[0]
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


def test_the_document_mask_is_built_once_per_microbatch(monkeypatch):
    built = []
    make = flex_backend.document_block_mask
    monkeypatch.setattr(flex_backend, "document_block_mask", lambda doc: built.append(doc) or make(doc))
    q, k, v = _qkv(64, 64, 4, 2)
    docs = _documents(2, 64, [20, 7])
    with torch.no_grad():
        for _layer in range(3):
            dispatch.attention(q, k, v, backend="flex", doc_ids=docs.ids, doc_ids_host=docs.host,
                               doc_derived=docs.derived)
        assert len(built) == 1
        dispatch.attention(q, k, v, backend="flex", doc_ids=docs.ids, doc_ids_host=docs.host)  # nothing to keep it in
    assert len(built) == 2 and flex_backend.FLEX_MASK_KEY in docs.derived


@pytest.mark.sweep
def test_the_compiled_mask_builder_cuda_uses_gives_the_eager_masks():
    """CUDA builds its block masks with create_block_mask compiled (flex_backend._block_mask_builder): the same
    blocks as the eager builder the CPU uses, and one graph for every microbatch's ids (the ids are an input
    of the compiled builder, not a guard). A sweep case: the compile takes about 20 s on 2 cores."""
    compiled, eager = flex_backend._block_mask_builder("cuda"), flex_backend._block_mask_builder("cpu")
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    for lengths in ([50, 13, 1, 90], [7, 200], [300]):
        doc = _documents(2, 300, lengths).ids

        def causal_document(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])
        got, want = (build(causal_document, 2, None, 300, 300, device="cpu") for build in (compiled, eager))
        for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
            assert torch.equal(getattr(got, name), getattr(want, name)), (lengths, name)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1


def test_selector():
    f32, f64 = torch.zeros(1, 8, 2, 8), torch.zeros(1, 8, 2, 8, dtype=torch.float64)
    with torch.no_grad():
        assert select_attention("flex", f32, need_lse=False) == "flex"
    # blocks that merge through their lse (CP), and fp64, run as auto
    assert select_attention("flex", f32, need_lse=True) == select_attention("auto", f32, need_lse=True)
    assert select_attention("flex", f64, need_lse=False) == "reference"
    assert select_attention("flex", torch.zeros(1, 8, 2, 64, device="meta", dtype=torch.bfloat16), False) == "library"
    with pytest.raises(ValueError, match="model.attention=flex cannot run here: torch's FlexAttention has no "
                                         "backward on the CPU"):
        select_attention("flex", f32.requires_grad_(), need_lse=False)


def test_the_model_with_flex_scores_each_document_as_if_alone():
    """The packed windows' loss through the model with model.attention=flex equals the sum of every
    document's loss run alone through the torch reference (no gradients: the CPU has no flex backward)."""
    from doc_helpers import per_document_loss_sum
    from parity import enlarge_weights
    from test_documents import EDGE_WINDOWS, EOS

    from parallel3d.context_parallel import document_ids, document_positions
    from parallel3d.mesh import ParallelContext
    from parallel3d.models.config import ModelConfig
    from parallel3d.models.llama import Llama

    models = {}
    for attention in ("auto", "flex"):
        cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          ffn_hidden_size=64, max_seq_len=32, kernels="torch", attention=attention)
        models[attention] = Llama(cfg, ParallelContext.single())
    torch.manual_seed(7)
    enlarge_weights(models["auto"])
    models["flex"].load_state_dict(models["auto"].state_dict())
    windows = torch.tensor(list(EDGE_WINDOWS.values()))  # (4, 17): 16 inputs + the shifted targets
    ids, labels = windows[:, :-1], windows[:, 1:]
    doc = document_ids(ids, EOS)
    with torch.no_grad():
        got = float(models["flex"](ids, document_positions(doc), labels, documents=Documents.from_host(doc)))
    want, count = per_document_loss_sum(models["auto"], windows, EOS)
    assert count == ids.numel()
    assert abs(got - want) <= 1e-5 * abs(want), (got, want)


# ---- on a GPU (gpu_check.sh flex; tests_gpu): the compiled kernel, its backward, and the Trainer ---------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-3), (torch.bfloat16, 2e-2)])
def test_forward_and_backward_on_cuda_match_the_fp64_reference(dtype, tol):
    """Documents, GQA 8/2, a length off the 128-block grid; errors relative to the reference's largest value."""
    q, k, v = (t.cuda().requires_grad_() for t in _qkv(300, 300, 8, 2, d=64, dtype=dtype))
    docs = Documents.from_host(_documents(2, 300, [120, 7, 1, 64]).host, "cuda")
    out = dispatch.attention(q, k, v, backend="flex", doc_ids=docs.ids, doc_ids_host=docs.host,
                             doc_derived=docs.derived)  # (b, s, hq, d)
    do = torch.randn_like(out)
    got = (out, *torch.autograd.grad(out, (q, k, v), do))
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = attention_reference(*exact, True, None, q_doc=docs.ids, k_doc=docs.ids)[0]
    want = (ref_out, *torch.autograd.grad(ref_out, exact, do.double()))
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        err = float((g.double() - w).abs().max() / w.abs().max())
        assert err <= tol, f"{name}: max error {err:.2e} of the reference's largest value (tolerance {tol:g})"


@pytest.mark.gpu
def test_trainer_with_flex_matches_auto_on_cuda():
    """Three Trainer steps on packed documents, fp32: model.attention=flex gives auto's loss, grad_norm and
    weights (auto on CUDA: flash-attn's varlen entry where installed, else block-wise SDPA)."""
    from ckpt_helpers import build_trainer, make_config
    from parity import local_slices
    from test_trainer_regressions import PARITY, assert_parity

    from parallel3d.mesh import ParallelContext

    def run(attention):
        torch.manual_seed(0)
        cfg = make_config([*PARITY, "data.document_masking=true", "data.eos_id=3", f"model.attention={attention}"], 1)
        trainer = build_trainer(cfg, ParallelContext.single("cuda"))
        records = [trainer.train_step() for _ in range(3)]
        weights = {}
        for chunk in trainer.chunks:
            weights.update({k: (t.cpu(), *rest) for k, (t, *rest) in local_slices(chunk, "data").items()})
        return {"records": records, "weights": weights}
    assert_parity([run("flex")], run("auto"))
