"""model.expert_impl: every grouped-expert implementation against the per-expert loop (forward and
backward), the Triton grouped GEMM under TRITON_INTERPRET=1 on odd shapes, `auto`'s choice, and one MoE
layout through the Trainer."""
from __future__ import annotations

import pytest
import torch

from parallel3d.kernels.grouped_gemm import grouped_mm, grouped_mm_reference
from parallel3d.expert_parallel.experts import IMPLS, choose_impl, grouped_swiglu

ODD = [[0, 5, 17, 0], [1], [33, 0, 2], [0, 0]]


@pytest.mark.parametrize("counts", ODD)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_grouped_mm_matches_reference(counts, dtype):
    torch.manual_seed(len(counts))
    x = torch.randn(sum(counts), 24, dtype=dtype, requires_grad=True)  # K=24: not a block multiple
    w = torch.randn(len(counts), 19, 24, dtype=dtype, requires_grad=True)
    y, ref = grouped_mm(x, w, counts), grouped_mm_reference(x, w, counts)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, ref, **tol)
    g = torch.randn_like(ref)
    if x.shape[0] == 0:
        return
    for a, b in zip(torch.autograd.grad(y, (x, w), g), torch.autograd.grad(ref, (x, w), g)):
        torch.testing.assert_close(a, b, **tol)


def _weights(e=3, h=16, f=24, dtype=torch.float32):
    torch.manual_seed(0)
    return [(0.3 * torch.randn(*shape, dtype=dtype)).requires_grad_() for shape in ((e, f, h), (e, f, h), (e, h, f))]


@pytest.mark.parametrize("impl", [i for i in IMPLS if i not in ("auto", "loop")])
def test_every_impl_matches_loop(impl):
    counts = [5, 0, 11]
    x = torch.randn(16, 16, requires_grad=True)
    ws = _weights()
    ref = grouped_swiglu("loop", x, counts, *ws, backend="torch")
    got = grouped_swiglu(impl, x, counts, *ws, backend="torch")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(got, (x, *ws), g), torch.autograd.grad(ref, (x, *ws), g)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_auto_choice():
    x = torch.zeros(4, 16)
    assert choose_impl("auto", x, 16, 24) == "loop"  # measured fastest on the CPU (benchmarks/experts.py)
    assert choose_impl("auto", torch.zeros(4, 16, dtype=torch.bfloat16, device="meta"), 16, 24) == "grouped_mm"
    assert choose_impl("auto", torch.zeros(4, 16, device="meta"), 16, 24) == "loop"
    assert choose_impl("loop", x, 16, 24) == "loop"
    assert choose_impl("auto", torch.zeros(4, 16, dtype=torch.float64), 16, 24) == "loop"


def test_moe_trainer_parity_across_impls():
    """One MoE model through the Trainer: loss and weights after 2 AdamW steps equal to the loop's for the
    grouped implementations (auto is the loop on this CPU; padded is covered above)."""
    from test_trainer_regressions import MOE, assert_parity, run

    small = [*MOE, "train.seq_len=16", "train.global_batch_size=2"]  # the Triton interpreter is slow
    ref = run(None, [*small, "model.expert_impl=loop"], 2)
    for impl in ("grouped_mm", "triton"):
        assert_parity([run(None, [*small, f"model.expert_impl={impl}"], 2)], ref)
