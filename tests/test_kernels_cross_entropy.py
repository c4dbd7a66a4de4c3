"""Cross-entropy Triton kernels vs torch reference: full vocab, vocab-parallel pieces, fused linear + CE.

Tolerances: losses fp32 atol=rtol=1e-5 (fp32 logits) and 1e-4 (bf16 logits: both sides read the same bf16
values, statistics are fp32); logit gradients fp32 1e-5, bf16 atol=rtol=2e-2 (one ulp of a value <= 1,
the interpreter truncates on fp32->bf16); gradcheck in fp64 (fast mode). BLOCK_V is forced small so that
rows span several vocab chunks with a ragged last one.
"""
import threading

import pytest
import torch

from parallel3d.kernels import dispatch
from parallel3d.kernels.cross_entropy import (cross_entropy, cross_entropy_partial_grad, cross_entropy_partial_stats,
                                   cross_entropy_reference, vocab_parallel_cross_entropy)
from parallel3d.kernels.fused_linear_cross_entropy import (fused_linear_cross_entropy,
                                                fused_linear_cross_entropy_reference)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOSS_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-4, rtol=1e-4)}
GRAD_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def _data(n, v, dtype, seed=0):
    torch.manual_seed(seed)
    logits = (3 * torch.randn(n, v, device=DEVICE)).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), device=DEVICE)
    target[[1, n - 2]] = -100
    return logits, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_reference(dtype):
    logits, target = _data(13, 301, dtype)
    loss, ref = cross_entropy(logits, target, -100, block_v=64), cross_entropy_reference(logits, target, -100)
    assert loss.dtype == torch.float32 and loss.shape == (13,)
    torch.testing.assert_close(loss, ref, **LOSS_TOL[dtype])
    assert loss[1] == 0 and loss[11] == 0
    g = torch.rand_like(loss)
    (a,), (b,) = torch.autograd.grad(loss, logits, g), torch.autograd.grad(ref, logits, g)
    assert a.dtype == dtype
    torch.testing.assert_close(a, b, **GRAD_TOL[dtype])
    assert (a[1] == 0).all()


def test_cross_entropy_gradcheck_fp64():
    logits = torch.randn(4, 9, dtype=torch.float64, device=DEVICE, requires_grad=True)
    target = torch.tensor([1, -100, 8, 0], device=DEVICE)
    assert torch.autograd.gradcheck(lambda x: cross_entropy(x, target, -100, block_v=4), (logits,),
                                    fast_mode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_partial_vocab_pieces_combine_to_full_loss(dtype):
    """Simulate tp=3 uneven vocab shards in one process: combine as the module docstring says."""
    logits, target = _data(9, 203, dtype, seed=1)
    bounds = [0, 70, 150, 203]
    shards = [(s, logits.detach()[:, s:e]) for s, e in zip(bounds, bounds[1:])]
    stats = [cross_entropy_partial_stats(x, target, s, -100, block_v=32) for s, x in shards]
    for (s, x), got in zip(shards, stats):
        for a, b in zip(got, dispatch.cross_entropy_partial_stats(x, target, s, -100, backend="torch")):
            torch.testing.assert_close(a, b, **LOSS_TOL[dtype])
    gmax = torch.stack([m for m, _, _ in stats]).amax(0)  # all_reduce MAX
    sumexp = sum(se * torch.exp(m - gmax) for m, se, _ in stats)  # all_reduce SUM
    tlogit = sum(t for _, _, t in stats)  # all_reduce SUM
    lse = gmax + torch.log(sumexp)
    loss = torch.where(target != -100, lse - tlogit, torch.zeros_like(lse))
    ref = cross_entropy_reference(logits, target, -100)
    torch.testing.assert_close(loss, ref, **LOSS_TOL[dtype])
    g = torch.rand_like(ref)
    grad = torch.cat([cross_entropy_partial_grad(x, target, s, lse, g, -100, block_v=32) for s, x in shards], 1)
    (grad_ref,) = torch.autograd.grad(ref, logits, g)
    torch.testing.assert_close(grad, grad_ref, **GRAD_TOL[dtype])
    grad_torch = torch.cat([dispatch.cross_entropy_partial_grad(x, target, s, lse, g, -100, backend="torch")
                            for s, x in shards], 1)
    torch.testing.assert_close(grad_torch, grad_ref, **GRAD_TOL[dtype])


def test_vocab_parallel_autograd_with_identity_reduce_is_full_ce():
    logits, target = _data(6, 50, torch.float32, seed=2)
    ident = lambda t: t  # noqa: E731  (tp=1: the all-reduces are identities)
    loss = vocab_parallel_cross_entropy(logits, target, 0, -100, ident, ident)
    ref = cross_entropy_reference(logits, target, -100)
    torch.testing.assert_close(loss, ref)
    g = torch.rand_like(ref)
    torch.testing.assert_close(torch.autograd.grad(loss, logits, g)[0], torch.autograd.grad(ref, logits, g)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_triton", [True, False])
def test_fused_linear_cross_entropy_matches_unfused(dtype, use_triton):
    torch.manual_seed(3)
    hidden = torch.randn(2, 11, 24, dtype=dtype, device=DEVICE, requires_grad=True)
    weight = (0.3 * torch.randn(150, 24, device=DEVICE)).to(dtype).requires_grad_()
    target = torch.randint(0, 150, (22,), device=DEVICE)
    target[3] = -100
    loss = fused_linear_cross_entropy(hidden, weight, target, -100, chunk=8, use_triton=use_triton)
    ref = fused_linear_cross_entropy_reference(hidden.reshape(-1, 24), weight, target, -100)
    torch.testing.assert_close(loss, ref, **LOSS_TOL[dtype])
    g = torch.rand_like(ref)
    grads, grads_ref = torch.autograd.grad(loss, (hidden, weight), g), torch.autograd.grad(ref, (hidden, weight), g)
    for a, b in zip(grads, grads_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **GRAD_TOL[dtype])


def test_fused_linear_cross_entropy_gradcheck_fp64_and_dispatch():
    hidden = torch.randn(5, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    weight = torch.randn(7, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    target = torch.tensor([0, 6, -100, 3, 2], device=DEVICE)
    assert torch.autograd.gradcheck(lambda h, w: fused_linear_cross_entropy(h, w, target, -100, 2, True),
                                    (hidden, weight), fast_mode=True)
    a = dispatch.fused_linear_cross_entropy(hidden, weight, target, -100, 3, backend="triton")
    b = dispatch.fused_linear_cross_entropy(hidden, weight, target, -100, 3, backend="torch")
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("use_triton", [True, False])
@pytest.mark.parametrize("n,h,v,chunk", [(21, 24, 150, 8), (13, 10, 67, 13), (9, 6, 33, 4)])
def test_fused_linear_cross_entropy_sum_grads_in_forward(dtype, use_triton, n, h, v, chunk):
    """reduction="sum" (the model's head): gradients formed in the forward, scaled by the incoming scalar,
    match the unfused head's over odd shapes, ragged chunks and ignored rows; no_grad runs statistics only."""
    torch.manual_seed(n)
    hidden = torch.randn(n, h, dtype=dtype, device=DEVICE, requires_grad=True)
    weight = (0.3 * torch.randn(v, h, device=DEVICE)).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), device=DEVICE)
    target[[0, n - 1]] = -100
    loss = fused_linear_cross_entropy(hidden, weight, target, -100, chunk=chunk, use_triton=use_triton,
                                      reduction="sum")
    ref = fused_linear_cross_entropy_reference(hidden, weight, target, -100).sum()
    assert loss.shape == () and loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, **LOSS_TOL[dtype])
    g = torch.tensor(0.37, device=DEVICE)
    grads, grads_ref = torch.autograd.grad(loss, (hidden, weight), g), torch.autograd.grad(ref, (hidden, weight), g)
    for a, b in zip(grads, grads_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **GRAD_TOL[dtype])
    with torch.no_grad():
        torch.testing.assert_close(fused_linear_cross_entropy(hidden, weight, target, -100, chunk=chunk,
                                                              use_triton=use_triton, reduction="sum"), loss)


def test_fused_linear_cross_entropy_sum_gradcheck_and_one_input():
    hidden = torch.randn(5, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    weight = torch.randn(7, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    target = torch.tensor([0, 6, -100, 3, 2], device=DEVICE)
    for use_triton in (True, False):
        assert torch.autograd.gradcheck(
            lambda h, w: fused_linear_cross_entropy(h, w, target, -100, 2, use_triton, reduction="sum"),
            (hidden, weight), fast_mode=True)
    # only the weight needs a gradient (a frozen trunk): d hidden is not formed
    loss = fused_linear_cross_entropy(hidden.detach(), weight, target, -100, 2, True, reduction="sum")
    ref = fused_linear_cross_entropy_reference(hidden.detach(), weight, target, -100).sum()
    torch.testing.assert_close(torch.autograd.grad(loss, weight)[0], torch.autograd.grad(ref, weight)[0])


def test_fused_linear_cross_entropy_sum_scales_16_bit_grads_in_fp32():
    """The backward's scale (e.g. 1 / tokens) multiplies the bf16 gradients in fp32, one rounding: never
    rounded to bf16 itself first (an error of up to 2^-9 on every gradient)."""
    torch.manual_seed(5)
    hidden = torch.randn(12, 16, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    weight = torch.randn(40, 16, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
    target = torch.randint(0, 40, (12,), device=DEVICE)

    def grads(g):
        loss = fused_linear_cross_entropy(hidden, weight, target, -100, 5, False, reduction="sum")
        return torch.autograd.grad(loss, (hidden, weight), torch.tensor(g, device=DEVICE))
    g = 1 / 3000
    (dh1, dw1), (dh, dw) = grads(1.0), grads(g)
    torch.testing.assert_close(dh, (dh1.float() * g).to(torch.bfloat16), rtol=0, atol=0)  # bf16 d hidden rows
    # d weight: its fp32 accumulator times g, rounded once (dw1 is that accumulator already rounded)
    torch.testing.assert_close(dw.float(), dw1.float() * g, rtol=2 ** -7, atol=0)  # two roundings at most


class _ThreadGroup:
    """A fake TP group for ranks run as threads in one process: all-reduce = barrier + stack + reduce."""

    def __init__(self, world: int):
        self.slots = [None] * world
        self.barrier = threading.Barrier(world, timeout=60)

    def reducer(self, rank: int, op: str):
        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = t
            self.barrier.wait()
            stacked = torch.stack(self.slots)
            out = stacked.amax(0) if op == "max" else stacked.sum(0)
            self.barrier.wait()  # everyone has read the slots before they are reused
            return out
        return all_reduce


@pytest.mark.parametrize("reduction", ["none", "sum"])
def test_fused_linear_cross_entropy_vocab_parallel_threads(reduction):
    """tp=2 with uneven vocab shards (threads as ranks, torch per-chunk path: the Triton partial kernels
    are covered above): every rank gets the full loss, shard weight grads concatenate to the full one and
    the partial d hidden sum to it."""
    torch.manual_seed(4)
    hidden = torch.randn(10, 16, device=DEVICE, requires_grad=True)
    weight = torch.randn(90, 16, device=DEVICE, requires_grad=True)
    target = torch.randint(0, 90, (10,), device=DEVICE)
    target[0] = -100
    ref = fused_linear_cross_entropy_reference(hidden, weight, target, -100)
    g = torch.rand_like(ref)
    ref_dh, ref_dw = torch.autograd.grad(ref, (hidden, weight), g, retain_graph=True)
    gs = torch.tensor(0.7, device=DEVICE)
    if reduction == "sum":  # the summed loss: the reference's gradients for the scalar dloss gs
        ref = ref.sum()
        ref_dh, ref_dw = torch.autograd.grad(ref, (hidden, weight), gs)
    bounds, group, results = [0, 40, 90], _ThreadGroup(2), [None, None]

    def rank_fn(rank: int) -> None:
        h = hidden.detach().clone().requires_grad_()
        w = weight.detach()[bounds[rank]:bounds[rank + 1]].clone().requires_grad_()
        loss = fused_linear_cross_entropy(h, w, target, -100, chunk=4, use_triton=False,
                                          vocab_start=bounds[rank], all_reduce_max=group.reducer(rank, "max"),
                                          all_reduce_sum=group.reducer(rank, "sum"), reduction=reduction)
        results[rank] = (loss.detach(), *torch.autograd.grad(loss, (h, w), g if reduction == "none" else gs))

    threads = [threading.Thread(target=rank_fn, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for loss, _, _ in results:
        torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(results[0][1] + results[1][1], ref_dh)
    torch.testing.assert_close(torch.cat([results[0][2], results[1][2]]), ref_dw)


@pytest.mark.gpu
def test_cross_entropy_large_vocab_bf16_cuda():
    logits = torch.randn(4096, 128256, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    target = torch.randint(0, 128256, (4096,), device="cuda")
    loss, ref = cross_entropy(logits, target), cross_entropy_reference(logits, target)
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-4)
    g = torch.rand_like(ref)
    torch.testing.assert_close(torch.autograd.grad(loss, logits, g)[0], torch.autograd.grad(ref, logits, g)[0],
                               atol=2e-2, rtol=2e-2)
