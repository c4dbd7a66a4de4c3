"""Tensor-parallel layers against their unsharded torch twins, and Megatron's communication volumes."""
import pytest
import torch
import torch.nn.functional as F

from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Block
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.params import init_parameters, real_part
from parallel3d.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                        scatter_to_sp, vocab_parallel_cross_entropy)
from parallel3d.tensor_parallel.layers import vocab_shard


def _layers_vs_twins(w, sp):
    ctx = w.context(MeshSpec(tp=w.world_size))
    tp, r = ctx.tp, ctx.tp.rank
    torch.manual_seed(0)
    b, s, h, out, vocab = 2, 8, 12, 16, 13
    x = torch.randn(b, s, h, requires_grad=True)
    ids = torch.randint(0, vocab, (b, s))
    col = ColumnParallelLinear(h, out, tp, sp, gather_output=True)
    row = RowParallelLinear(out, h, tp, sp)
    emb = VocabParallelEmbedding(vocab, h, tp, sp)
    for i, m in enumerate((col, row, emb)):
        init_parameters(m, seed=i)
    w_col = torch.randn(out, h, generator=torch.Generator().manual_seed(1))
    # reference weights: the full tensors the init draws (identical on every layout)
    from parallel3d.params import global_init_tensor
    full = {n: global_init_tensor(i, "weight", m.weight.meta, 0.02) for i, (n, m) in
            enumerate([("col", col), ("row", row), ("emb", emb)])}
    del w_col
    x_in = scatter_to_sp(x, tp) if sp else x
    y = col(x_in)                                  # (b, s, out) gathered
    z = row(y.chunk(tp.size, -1)[r])                # (b, s or s/tp, h)
    e = emb(ids)
    loss = (y.square().sum() + z.square().sum() * (1 if not sp else 1) + e.square().sum())
    loss.backward()
    xr = x.detach().clone().requires_grad_(True)
    yr = F.linear(xr, full["col"])
    zr = F.linear(yr, full["row"])
    er = F.embedding(ids, full["emb"])
    zr_local = zr.chunk(tp.size, 1)[r] if sp else zr
    er_local = er.chunk(tp.size, 1)[r] if sp else er
    return dict(y=(y, yr), z=(z, zr_local), e=(e, er_local),
                x_grad=(x.grad, None), col_grad=(real_part(col.weight.grad, col.weight.meta), col.weight.meta.slices),
                row_grad=(row.weight.grad, row.weight.meta.slices), emb_grad=(real_part(emb.weight.grad, emb.weight.meta),
                                                                            emb.weight.meta.slices), full=full, x=x.detach(), ids=ids)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, True)])
def test_layers_match_unsharded_twins(worlds, tp, sp):
    results = worlds.run(tp, _layers_vs_twins, sp)
    full, x, ids = results[0]["full"], results[0]["x"], results[0]["ids"]
    xr = x.clone().requires_grad_(True)
    wc, wr, we = (full[k].clone().requires_grad_(True) for k in ("col", "row", "emb"))
    yr = F.linear(xr, wc)
    zr = F.linear(yr, wr)
    er = F.embedding(ids, we)
    (yr.square().sum() + zr.square().sum() + er.square().sum()).backward()
    for res in results:
        for key in ("y", "z", "e"):
            torch.testing.assert_close(res[key][0], res[key][1], rtol=1e-5, atol=1e-5)
        # with sp each rank's x grad is its sequence part; without sp the full (replicated) grad
        torch.testing.assert_close(res["x_grad"][0], xr.grad, rtol=1e-5, atol=1e-5)
        for key, ref in (("col_grad", wc.grad), ("row_grad", wr.grad), ("emb_grad", we.grad)):
            g, slices = res[key]
            torch.testing.assert_close(g, ref[slices], rtol=1e-5, atol=1e-5)


def _vocab_ce(w, vocab):
    ctx = w.context(MeshSpec(tp=w.world_size))
    torch.manual_seed(0)
    logits = torch.randn(10, vocab) * 3
    target = torch.randint(0, vocab, (10,))
    target[3] = -100
    start, real, local = vocab_shard(vocab, ctx.tp.size, ctx.tp.rank)
    shard = torch.zeros(10, local)
    shard[:, :real] = logits[:, start:start + real]
    shard.requires_grad_(True)
    loss = vocab_parallel_cross_entropy(shard, target, ctx.tp, start, real, -100)
    loss.sum().backward()
    return loss.detach(), shard.grad[:, :real], shard.grad[:, real:], (start, real), logits, target


@pytest.mark.parametrize("tp,vocab", [(2, 16), (4, 13), (4, 5)])
def test_vocab_parallel_cross_entropy(worlds, tp, vocab):
    for loss, grad, pad_grad, (start, real), logits, target in worlds.run(tp, _vocab_ce, vocab):
        ref_logits = logits.clone().requires_grad_(True)
        ref = F.cross_entropy(ref_logits, target, ignore_index=-100, reduction="none")
        ref.sum().backward()
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, ref_logits.grad[:, start:start + real], rtol=1e-6, atol=1e-6)
        assert pad_grad.abs().sum() == 0  # padding never receives gradient


def _block_comm(w, sp):
    ctx = w.context(MeshSpec(tp=w.world_size))
    cfg = ModelConfig(vocab_size=64, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden_size=48)
    block = Block(cfg, ctx, sp, "ring", "none")
    init_parameters(block, 0)
    b, s, h = 2, 8, cfg.hidden_size
    x = torch.randn(b, s // ctx.tp.size if sp else s, h, requires_grad=True)
    from parallel3d.kernels.rope import rope_cos_sin, rope_inv_freq
    cos, sin = rope_cos_sin(torch.arange(s), rope_inv_freq(cfg.attn_head_dim, cfg.rope_theta))
    ctx.stats.reset()
    y = block(x, cos, sin)
    fwd = ctx.stats.summary()
    ctx.stats.reset()
    y.sum().backward()
    return fwd, ctx.stats.summary(), b * s * h * 4


@pytest.mark.parametrize("sp", [False, True])
def test_block_communication_volume(worlds, sp):
    for fwd, bwd, bsh in worlds.run(2, _block_comm, sp):
        if not sp:  # Megatron: 2 all-reduces of b*s*h forward (g after attention and MLP), 2 in backward (f)
            assert fwd == {("tp", "all_reduce"): (2, 2 * bsh)}
            assert bwd == {("tp", "all_reduce"): (2, 2 * bsh)}
        else:       # same volume as all-gather + reduce-scatter pairs, plus backward's all-gather of each
            expected = {("tp", "all_gather"): (2, 2 * bsh), ("tp", "reduce_scatter"): (2, 2 * bsh)}
            assert fwd == expected  # region's saved (b, s/tp, h) shard (tensor_parallel/region.py)
            assert bwd == {**expected, ("tp", "all_gather"): (4, 4 * bsh)}


def test_bad_head_count_for_tp():
    from parallel3d.comm import Group
    ctx = ParallelContext.single()
    ctx.tp = Group("tp", [0, 1, 2, 3], 0)  # a 4-way TP view is enough to reach the check, no communication
    with pytest.raises(ValueError, match="model.num_heads=6 is not divisible by parallel.tp=4"):
        from parallel3d.models.llama import Llama
        Llama(ModelConfig(hidden_size=48, num_heads=6, num_kv_heads=2), ctx)
