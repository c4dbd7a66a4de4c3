"""MoE dispatch units: permutation round trips, grouped experts, the layer against a per-token reference,
recomputation, communication accounting (gloo) and bad input."""
import pytest
import torch
import torch.nn.functional as F

from parallel3d.models.config import ModelConfig
from parallel3d.models.moe import MoETransformer
from parallel3d.expert_parallel import MoELayer, permute, unpermute
from parallel3d.expert_parallel.dispatch import kept_counts
from parallel3d.expert_parallel.experts import (grouped_swiglu_loop, grouped_swiglu_padded, per_expert_reference)
from parallel3d.expert_parallel.router import capacity_keep_mask, expert_capacity
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.params import init_parameters


def _routing(t=24, e=6, k=2, seed=0):
    return torch.rand(t, e, generator=torch.Generator().manual_seed(seed)).topk(k, dim=-1).indices


def test_permute_sorts_by_expert_and_counts():
    idx = _routing()
    perm = permute(idx, 6)
    assert torch.equal(perm.counts, torch.bincount(idx.flatten(), minlength=6))
    experts = idx.flatten()[perm.order]
    assert torch.equal(experts, experts.sort().values)  # expert-major
    for e in range(6):  # stable: token order inside each expert
        toks = perm.token_index[experts == e]
        assert torch.equal(toks, toks.sort().values)


def test_unpermute_round_trip_and_weights():
    idx, x = _routing(), torch.randn(24, 5)
    perm = permute(idx, 6)
    rows = x[perm.token_index]  # (T*k, h)
    torch.testing.assert_close(unpermute(rows, perm, torch.ones(24, 2)), 2 * x)
    w = torch.rand(24, 2)
    torch.testing.assert_close(unpermute(rows, perm, w), x * w.sum(-1, keepdim=True))


def test_dropped_slots_are_not_sent_and_contribute_zero():
    idx, x = _routing(), torch.randn(24, 5)
    keep = torch.rand(24, 2, generator=torch.Generator().manual_seed(1)) > 0.3
    perm = permute(idx, 6, keep, kept=int(keep.sum()))
    assert perm.order.numel() == int(keep.sum())
    assert torch.equal(perm.counts, torch.bincount(idx[keep], minlength=6))
    out = unpermute(x[perm.token_index], perm, torch.ones(24, 2))
    torch.testing.assert_close(out, x * keep.sum(-1, keepdim=True).float())


@pytest.mark.parametrize("counts", [[5, 0, 7, 3], [0, 0, 0, 4], [0, 0, 0, 0]])
def test_grouped_experts_match_per_expert_reference(counts):
    gen = torch.Generator().manual_seed(2)
    e, h, f = len(counts), 8, 12
    x = torch.randn(sum(counts), h, generator=gen)
    w = [torch.randn(e, f, h, generator=gen), torch.randn(e, f, h, generator=gen), torch.randn(e, h, f, generator=gen)]
    expert = torch.repeat_interleave(torch.arange(e), torch.tensor(counts))
    results = []
    for fn in (grouped_swiglu_loop, grouped_swiglu_padded, None):
        xs = x.clone().requires_grad_()
        ws = [t.clone().requires_grad_() for t in w]
        y = per_expert_reference(xs, expert, *ws) if fn is None else fn(xs, counts, *ws)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append([y.detach(), xs.grad] + [t.grad for t in ws])
    for got in results[:2]:
        for a, b in zip(got, results[2]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _layer(ctx=None, capacity=0.0, shared=0, score="softmax", seed=0):
    ctx = ctx or ParallelContext.single()
    layer = MoELayer(16, 24, 4, 2, ctx, shared_ffn_hidden=shared, score=score, capacity_factor=capacity)
    init_parameters(layer, seed, 0.3)
    return layer


def _reference_layer(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Per-token loop: sum_j w_j * expert_{i_j}(x_t) (+ shared experts), dropped slots skipped."""
    b, s, h = x.shape
    tokens = x.reshape(-1, h)
    r = layer.router(tokens)
    keep = torch.ones_like(r.indices, dtype=torch.bool)
    if layer.capacity_factor:
        cap = expert_capacity(layer.capacity_factor, s, layer.top_k, layer.num_experts)
        keep = capacity_keep_mask(r.indices.view(b, s, -1), cap, layer.num_experts).view(b * s, -1)
    ex = layer.experts
    out = torch.zeros_like(tokens)
    for t in range(tokens.shape[0]):
        for j in range(layer.top_k):
            if keep[t, j]:
                e = r.indices[t, j]
                hid = F.silu(ex.gate_proj[e] @ tokens[t]) * (ex.up_proj[e] @ tokens[t])
                out[t] += r.weights[t, j] * (ex.down_proj[e] @ hid)
    if layer.shared_experts is not None:
        sh = layer.shared_experts
        out += F.linear(F.silu(F.linear(tokens, sh.gate_proj.weight)) * F.linear(tokens, sh.up_proj.weight),
                        sh.down_proj.weight)
    return out.view(b, s, h)


@pytest.mark.parametrize("capacity,shared,score", [(0.0, 0, "softmax"), (1.0, 0, "softmax"), (0.0, 12, "sigmoid")])
def test_layer_matches_per_token_reference(capacity, shared, score):
    layer = _layer(capacity=capacity, shared=shared, score=score)
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(layer(x), _reference_layer(layer, x), rtol=1e-5, atol=1e-5)
    if capacity:
        assert layer.local_load()[1].sum() > 0  # the test really drops something


def _moe_cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
                num_experts=4, moe_top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001, max_seq_len=32)
    base.update(kw)
    return ModelConfig(**base)


def test_aux_loss_value_and_full_recompute():
    cfg = _moe_cfg()
    x, y = torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))
    results = []
    for recompute in ("none", "full"):
        model = MoETransformer(cfg, ParallelContext.single(), recompute=recompute)
        model.init_weights(7)
        loss = model(x, torch.arange(16), y)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l0, l1)
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], msg=n)
    # the returned loss is CE sum + T * (aux_coef * aux + z_coef * z) summed over layers, with the balancing
    # loss as Hugging Face's Mixtral computes it (its f sums to k: ours is 1/k of it) and the ST-MoE z-loss
    # mean_t logsumexp(logits_t)^2, both from the router logits captured here, not from the model's values
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    captured = []
    hooks = [m.router.register_forward_hook(lambda mod, args, out: captured.append(out.logits.detach()))
             for m in model.moe_layers().values()]
    with torch.no_grad():
        ce = model(x, torch.arange(16)).flatten(0, 1)
        ce = F.cross_entropy(ce, y.flatten(), reduction="sum")
    for h in hooks:
        h.remove()
    assert len(captured) == cfg.num_layers
    extra = 0.0
    for logits in captured:
        aux = load_balancing_loss_func((logits,), cfg.num_experts, cfg.moe_top_k).item() / cfg.moe_top_k
        z = torch.logsumexp(logits, -1).pow(2).mean().item()
        extra += 32 * (cfg.aux_loss_coef * aux + cfg.z_loss_coef * z)
    assert l0.item() == pytest.approx(ce.item() + extra, rel=1e-5)
    assert extra > 1e-4 * ce.item()  # the aux terms are visible at this tolerance


def test_moe_load_stats_and_bias_update():
    cfg = _moe_cfg(router_bias_update_rate=0.1, router_score="sigmoid", capacity_factor=1.0, first_k_dense=1)
    model = MoETransformer(cfg, ParallelContext.single())
    model.init_weights(1)
    model(torch.randint(0, 64, (2, 16)), torch.arange(16), torch.randint(0, 64, (2, 16))).backward()
    peek = model.moe_load_stats(step_end=False)
    stats = model.moe_load_stats()
    assert peek == stats
    load = torch.tensor(stats["moe_tokens_per_expert.1"], dtype=torch.float)
    assert "moe_tokens_per_expert.0" not in stats and load.sum() == 2 * 16 * 2  # layer 0 is dense
    assert stats["moe_imbalance.1"] == pytest.approx((load.max() / load.mean()).item())
    assert stats["moe_imbalance_max"] == stats["moe_imbalance.1"]
    assert 0 < stats["moe_drop_fraction"] == sum(stats["moe_dropped_per_expert.1"]) / load.sum().item()
    assert set(stats) >= {"moe_aux_loss.1", "moe_z_loss.1"}
    bias = model.layers["1"].mlp.router.expert_bias
    torch.testing.assert_close(bias, 0.1 * torch.sign(load.mean() - load))
    assert model.moe_load_stats(step_end=False)["moe_tokens_per_expert.1"] == [0, 0, 0, 0]  # reset


# ---- communication accounting (gloo) ----------------------------------------------------------------------
def _accounting(w, ep, capacity):
    ctx = w.context(MeshSpec(dp=w.world_size, ep=ep))
    layer = _layer(ctx, capacity=capacity)
    x = torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(10 + w.rank))
    with torch.no_grad():
        r = layer.router(x.reshape(-1, 16))
        keep = None
        if capacity:
            keep = capacity_keep_mask(r.indices.view(2, 16, -1), expert_capacity(capacity, 16, 2, 4), 4).view(32, -1)
        counts = kept_counts(r.indices, 4, keep)
        ctx.stats.reset()
        layer(x)
        forward = ctx.stats.summary()
    ctx.stats.reset()
    layer(x.requires_grad_()).sum().backward()
    both = ctx.stats.summary()
    return counts, forward, both


@pytest.mark.parametrize("n,capacity", [(2, 0.0), (4, 0.0), (4, 1.0)])
def test_dispatch_moves_exactly_the_routed_tokens(worlds, n, capacity):
    out = worlds.run(n, _accounting, n, capacity)
    counts = torch.stack([c for c, _, _ in out])  # (ranks, E): slots each rank sends to each expert
    per_rank = 4 // n
    for r, (_, forward, both) in enumerate(out):
        sent = int(counts[r].sum())
        received = int(counts[:, r * per_rank:(r + 1) * per_rank].sum())
        token_bytes = (sent + received) * 16 * 4
        assert forward == {("ep", "all_to_all"): (3, 4 * 8 + token_bytes)}
        assert both == {("ep", "all_to_all"): (5, 4 * 8 + 2 * token_bytes)}
        if not capacity:
            assert sent == 2 * 16 * 2


def _skewed(w):
    """Every token picks experts 0 and 1 (both on EP rank 0): rank 1 sends and receives nothing for some
    experts and runs its experts on zero rows, and the result still equals the world-size-1 layer."""
    ctx = w.context(MeshSpec(dp=2, ep=2))
    layers = [_layer(ctx), _layer()]  # same global weights (seeded by name), EP-sharded and whole
    outs = []
    for layer in layers:
        with torch.no_grad():
            layer.router.expert_bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
        x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(w.rank)).requires_grad_()
        y = layer(x)
        y.square().sum().backward()
        outs.append((y.detach(), x.grad))
    received = layers[0].experts.gate_proj.grad.abs().sum().item()
    return outs, received, ctx.stats.summary()


def test_empty_splits_and_idle_experts(worlds):
    for rank, (outs, received, stats) in enumerate(worlds.run(2, _skewed)):
        (y, gx), (y_ref, gx_ref) = outs
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
        assert (received > 0) == (rank == 0)  # rank 1's experts saw no tokens: zero (not None) gradients


# ---- bad input ------------------------------------------------------------------------------------------
def test_bad_expert_configs():
    ctx = ParallelContext.create(MeshSpec(dp=4, ep=4), 0)  # groups without processes
    with pytest.raises(ValueError, match="num_experts=6 is not divisible by parallel.ep=4"):
        MoELayer(16, 24, 6, 2, ctx)
    with pytest.raises(ValueError, match="moe_top_k=5 must be in"):
        MoELayer(16, 24, 4, 5, ParallelContext.single())
    with pytest.raises(ValueError, match="moe_top_k=5 must be in"):
        MoETransformer(_moe_cfg(moe_top_k=5), ParallelContext.single())
    tp_ctx = ParallelContext.create(MeshSpec(tp=2, etp=2), 0)
    with pytest.raises(ValueError, match="moe_ffn_hidden_size=25 .* not divisible by parallel.etp=2"):
        MoELayer(16, 25, 4, 2, tp_ctx)
    with pytest.raises(ValueError, match="num_experts > 0"):
        MoETransformer(_moe_cfg(num_experts=0), ParallelContext.single())
