"""Context-parallel attention (ring / allgather / ulysses) against full attention on the whole sequence.

Tolerances (max abs error, values O(1)): fp64 1e-10, fp32 1e-5 on out, lse, dq, dk, dv.
The fp64 reference is explicit fp64 math here (the kernels' torch reference computes in fp32); the fp32
reference is `dispatch.attention_with_lse` on the unsharded sequence.
"""
from __future__ import annotations

import pytest
import torch

from parallel3d.kernels import dispatch
from parallel3d.context_parallel import (CP_MODES, context_parallel_attention, context_parallel_attention_with_lse,
                                         shard_sequence)
from parallel3d.context_parallel.blocks import block_attention, block_forward, merge_into
from parallel3d.mesh import MeshSpec, ParallelContext

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
HEADS = [(4, 4), (4, 2), (4, 1)]
SEQS = [16, 24, 40]


def _reference64(q, k, v, causal):
    """Plain fp64 attention with autograd -> (out, lse)."""
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(rep, 2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v.repeat_interleave(rep, 2)), lse


def _inputs(seed, seq, hq, hk, dtype, b=2, d=8):
    gen = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(b, seq, h, d, generator=gen, dtype=torch.float64).to(dtype) for h in (hq, hk, hk, hq))
    return q, k, v, do


def _full(q, k, v, do, causal):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if q.dtype == torch.float64:
        out, lse = _reference64(q, k, v, causal)
    else:
        out, lse = dispatch.attention_with_lse(q, k, v, causal, backend="torch")
    (out * do).sum().backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def _sharded(q, k, v, do, group, mode, causal):
    cp, r = group.size, group.rank
    q, k, v = (shard_sequence(t, cp, r).requires_grad_() for t in (q, k, v))
    out, lse = context_parallel_attention_with_lse(q, k, v, group, mode, causal, backend="torch")
    (out * shard_sequence(do, cp, r)).sum().backward()
    return out.detach(), lse, q.grad, k.grad, v.grad


def _attention_cases(w, mode):
    ctx = w.context(MeshSpec(cp=w.world_size))
    g, errors = ctx.cp, []
    for dtype in (torch.float64, torch.float32):
        for causal in (True, False):
            for hq, hk in HEADS:
                for seq in SEQS:
                    q, k, v, do = _inputs(seq + hk, seq, hq, hk, dtype)
                    ref = _full(q, k, v, do, causal)
                    got = _sharded(q, k, v, do, g, mode, causal)
                    ref_local = [shard_sequence(ref[0], g.size, g.rank), shard_sequence(ref[1], g.size, g.rank, 2)]
                    ref_local += [shard_sequence(t, g.size, g.rank) for t in ref[2:]]
                    err = max((a.double() - e.double()).abs().max().item() for a, e in zip(got, ref_local))
                    assert all(a.dtype == e.dtype for a, e in zip(got[:1] + got[2:], ref_local[:1] + ref_local[2:]))
                    errors.append((str(dtype), causal, hq, hk, seq, err))
    return errors


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("mode", CP_MODES)
def test_cp_attention_matches_full(worlds, mode, cp):
    for rank_errors in worlds.run(cp, _attention_cases, mode, timeout=180):
        for dtype, causal, hq, hk, seq, err in rank_errors:
            tol = TOL[torch.float64 if "64" in dtype else torch.float32]
            assert err <= tol, f"{mode} cp={cp} {dtype} causal={causal} hq={hq} hk={hk} seq={seq}: err {err:.3g}"


def _comm_volume(w, b=2, seq=32, hk=2, d=8):
    ctx = w.context(MeshSpec(cp=w.world_size))
    cp, g = w.world_size, ctx.cp
    q, k, v, do = _inputs(0, seq, 4, hk, torch.float32)
    q, k, v = (shard_sequence(t, cp, g.rank).requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q, k, v, g, "ring")
    fwd = ctx.stats.summary()
    ctx.stats.reset()
    out.backward(shard_sequence(do, cp, g.rank))
    bwd = ctx.stats.summary()
    ctx.stats.reset()
    context_parallel_attention(q, k, v, g, "allgather").sum().backward()
    return fwd, bwd, ctx.stats.summary()


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_sends_cp_minus_one_kv_blocks(worlds, cp):
    b, seq, hk, d = 2, 32, 2, 8
    kv_block = 2 * b * (seq // cp) * hk * d * 4  # packed K and V of one rank, fp32
    for fwd, bwd, ag in worlds.run(cp, _comm_volume):
        assert fwd == {("cp", "send"): (cp - 1, (cp - 1) * kv_block), ("cp", "recv"): (cp - 1, (cp - 1) * kv_block)}
        # backward (reverse ring, starting on the saved last block): K/V only between the first and the
        # own block (cp-2 hops) plus the dK/dV accumulators (cp-1 hops, the last one lands on the owner)
        n = (cp - 2) + (cp - 1)
        assert bwd == {("cp", "send"): (n, n * kv_block), ("cp", "recv"): (n, n * kv_block)}
        assert ag == {("cp", "all_gather"): (1, cp * kv_block), ("cp", "reduce_scatter"): (1, cp * kv_block)}


def _saved_bytes(fn) -> int:
    sizes = []

    def pack(t):
        if t.is_floating_point():
            sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes)


def _memory(w, seq=64):
    ctx = w.context(MeshSpec(cp=w.world_size))
    q, k, v, _ = _inputs(0, seq, 8, 4, torch.float32)  # kv heads divisible by cp: no ulysses replication
    q, k, v = (shard_sequence(t, w.world_size, ctx.cp.rank).requires_grad_() for t in (q, k, v))
    return {m: _saved_bytes(lambda: context_parallel_attention(q, k, v, ctx.cp, m)) for m in CP_MODES}


@pytest.mark.parametrize("cp", [2, 4])
def test_attention_activation_bytes_shrink_by_cp(worlds, cp):
    q, k, v, _ = _inputs(0, 64, 8, 4, torch.float32)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    single = _saved_bytes(lambda: context_parallel_attention(q, k, v, ParallelContext.single().cp))
    assert single == 4 * (2 * 64 * 8 * 8 * 2 + 2 * 64 * 4 * 8 * 2 + 2 * 8 * 64)  # q, k, v, out, lse
    kv_block = 4 * 2 * (64 // cp) * 4 * 8 * 2  # packed K/V of one rank (b=2, hk=4, d=8), fp32
    for per_mode in worlds.run(cp, _memory):
        assert per_mode["ring"] == single // cp + kv_block  # plus the last block received, for the backward
        assert per_mode["ulysses"] * cp == single
        assert per_mode["allgather"] > per_mode["ring"]  # it keeps the whole K/V sequence


def _bad_inputs(w):
    ctx = w.context(MeshSpec(cp=w.world_size))
    msgs = []
    for call in (lambda: context_parallel_attention(torch.randn(1, 5, 4, 8), torch.randn(1, 5, 2, 8),
                                                    torch.randn(1, 5, 2, 8), ctx.cp),
                 lambda: context_parallel_attention(torch.randn(1, 4, 3, 8), torch.randn(1, 4, 3, 8),
                                                    torch.randn(1, 4, 3, 8), ctx.cp, "ulysses"),
                 lambda: context_parallel_attention(torch.randn(1, 4, 4, 8), torch.randn(1, 4, 2, 8),
                                                    torch.randn(1, 4, 2, 8), ctx.cp, "zigzag")):
        try:
            call()
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_bad_inputs_raise_clear_errors(worlds):
    odd, heads, mode = worlds.run(2, _bad_inputs)[0]
    assert "local sequence length 5 is odd" in odd and "2*cp = 4" in odd
    assert "num_heads=3" in heads and "cp=2" in heads
    assert "unknown context-parallel mode 'zigzag'" in mode and "'ring', 'allgather', 'ulysses'" in mode


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_merge_of_key_halves_equals_full_attention(dtype):
    """out = sum_i exp(lse_i - lse) out_i over disjoint key sets reproduces the full softmax."""
    q, k, v, _ = _inputs(3, 24, 4, 2, dtype)
    ref_out, ref_lse = block_forward(q, k, v, False, 8 ** -0.5, "torch")
    out = torch.zeros(q.shape, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    lse = torch.full((2, 4, 24), float("-inf"), dtype=out.dtype)
    for ks in (slice(0, 10), slice(10, 24)):
        merge_into(out, lse, *block_forward(q, k[:, ks], v[:, ks], False, 8 ** -0.5, "torch"))
    assert (out.to(dtype) - ref_out).abs().max() <= TOL[dtype]
    assert (lse - ref_lse).abs().max() <= TOL[dtype]
    plain_sum = sum(block_forward(q, k[:, ks], v[:, ks], False, 8 ** -0.5, "torch")[0] for ks in (slice(0, 10),
                                                                                                  slice(10, 24)))
    assert (plain_sum - ref_out).abs().max() > 1e-2  # adding partial outputs is wrong


def test_block_attention_gradients_fp64():
    q, k, v, _ = _inputs(5, 12, 4, 2, torch.float64)
    small = [t[:1, :6, :, :4].clone().requires_grad_() for t in (q, k, v)]  # gradcheck is O(numel^2)
    for causal in (True, False):
        assert torch.autograd.gradcheck(lambda a, b, c: block_attention(a, b, c, causal, None, "torch")[0], small)
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = _reference64(*args, causal)
        got = block_attention(*args, causal, None, "torch")
        assert (ref[0] - got[0]).abs().max() < 1e-12 and (ref[1] - got[1]).abs().max() < 1e-12


def _triton_ring(w, mode):
    ctx = w.context(MeshSpec(cp=w.world_size))
    g = ctx.cp
    q, k, v, do = _inputs(1, 16, 4, 2, torch.float32, b=1, d=16)
    ref = _full(q, k, v, do, True)
    q, k, v = (shard_sequence(t, g.size, g.rank).requires_grad_() for t in (q, k, v))
    out, lse = context_parallel_attention_with_lse(q, k, v, g, mode, True, backend="triton")
    (out * shard_sequence(do, g.size, g.rank)).sum().backward()
    got = (out.detach(), lse, q.grad, k.grad, v.grad)
    want = [shard_sequence(ref[0], g.size, g.rank), shard_sequence(ref[1], g.size, g.rank, 2)]
    want += [shard_sequence(t, g.size, g.rank) for t in ref[2:]]
    return max((a - e).abs().max().item() for a, e in zip(got, want))


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_triton_block_kernels_plug_in(worlds, mode):
    """backend="triton" (interpreted on CPU): forward via dispatch.attention_with_lse, backward via the
    kernel's flash_attention_backward taking the merged out/lse."""
    for err in worlds.run(2, _triton_ring, mode, timeout=180):
        assert err <= 1e-5
