"""MoE router units (no processes): top-k scores, auxiliary losses, bias balancing, capacity dropping."""
import math

import pytest
import torch

from parallel3d.expert_parallel.router import (Router, balance_probs, capacity_keep_mask, expert_capacity,
                                               expert_counts, sharded_capacity_keep_mask, switch_aux_loss,
                                               update_expert_bias, z_loss_sum)
from parallel3d.mesh import ParallelContext


def _router(e=8, k=2, score="softmax", norm=True, h=16, seed=0):
    ctx = ParallelContext.single()
    r = Router(h, e, k, ctx.tp, score, norm)
    with torch.no_grad():
        r.weight.copy_(torch.randn(e, h, generator=torch.Generator().manual_seed(seed)))
    return r


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm", [True, False])
def test_topk_scores_and_weights(score, norm):
    r = _router(score=score, norm=norm)
    x = torch.randn(32, 16)
    out = r(x)
    logits = x @ r.weight.T
    scores = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    top, idx = scores.topk(2, dim=-1)
    assert torch.equal(out.indices, idx)
    want = top / top.sum(-1, keepdim=True) if norm else top
    torch.testing.assert_close(out.weights, want)
    torch.testing.assert_close(out.scores, scores)


def test_bias_changes_selection_not_weights():
    r = _router(e=4, k=1, norm=False)
    x = torch.randn(64, 16)
    base = r(x)
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([10.0, 0, 0, 0]))  # expert 0 wins every token
    biased = r(x)
    assert torch.all(biased.indices == 0)
    torch.testing.assert_close(biased.weights[:, 0], base.scores[:, 0])  # weight is the unbiased score
    assert biased.weights.requires_grad


def test_aux_loss_balanced_is_one_and_matches_hugging_face():
    e, k, t = 4, 2, 64
    uniform = torch.full((t, e), 1.0 / e)
    counts = torch.full((e,), t * k / e)
    assert switch_aux_loss(uniform.sum(0), counts, t, k).item() == pytest.approx(1.0)
    # Hugging Face's Mixtral loss for one layer is k times ours (its routed fraction sums to k)
    transformers = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(1))
    probs = logits.softmax(-1)
    idx = probs.topk(k, dim=-1).indices
    ours = switch_aux_loss(probs.sum(0), expert_counts(idx, e), t, k)
    hf = transformers.load_balancing_loss_func((logits,), e, k)
    torch.testing.assert_close(ours * k, hf)


def test_z_loss_and_sigmoid_balance_probs():
    # ST-MoE's router z-loss term per token is log(sum_j exp(x_j))^2. By hand: rows [0, 0] and [ln 3, 0]
    # have log-sum-exp ln 2 and ln 4 = 2 ln 2, so the sum is 5 (ln 2)^2.
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    assert z_loss_sum(logits).item() == pytest.approx(5 * math.log(2.0) ** 2, rel=1e-6)
    big = torch.tensor([[1000.0, 1000.0]])  # must not overflow: lse = 1000 + ln 2
    assert z_loss_sum(big).item() == pytest.approx((1000 + math.log(2.0)) ** 2, rel=1e-6)
    logits = torch.randn(10, 6)
    p = balance_probs(logits.sigmoid(), "sigmoid")
    torch.testing.assert_close(p.sum(-1), torch.ones(10))


def test_bias_update_moves_load_towards_balance():
    """A skewed synthetic router: DeepSeek-V3 bias updates flatten the load without touching the logits."""
    gen = torch.Generator().manual_seed(0)
    e, k, t = 8, 2, 512
    skew = torch.linspace(2.0, -2.0, e)  # expert 0 strongly preferred
    bias = torch.zeros(e)

    def load() -> torch.Tensor:
        scores = (torch.randn(t, e, generator=gen) + skew).sigmoid()
        return expert_counts((scores + bias).topk(k, dim=-1).indices, e).float()

    first = load()
    for _ in range(200):
        update_expert_bias(bias, load(), rate=0.01)
    last = torch.stack([load() for _ in range(5)]).mean(0)
    imbalance = lambda c: (c.max() / c.mean()).item()  # noqa: E731
    assert imbalance(first) > 2.0
    assert imbalance(last) < 1.25 < imbalance(first)
    assert bias[0] < 0 < bias[-1]


def test_capacity_keeps_earliest_positions():
    assert expert_capacity(0.0, 16, 2, 4) == -1
    assert expert_capacity(1.0, 16, 2, 4) == 8 and expert_capacity(1.25, 10, 2, 8) == math.ceil(1.25 * 10 * 2 / 8)
    idx = torch.tensor([[[0, 1], [0, 2], [0, 1], [3, 0]]])  # (b=1, s=4, k=2)
    keep = capacity_keep_mask(idx, capacity=2, num_experts=4)
    want = torch.tensor([[[True, True], [True, True], [False, True], [True, False]]])
    assert torch.equal(keep, want)


def test_capacity_is_per_sequence_and_deterministic():
    gen = torch.Generator().manual_seed(3)
    e, k, b, s = 8, 2, 6, 32
    idx = torch.rand(b, s, e, generator=gen).topk(k, dim=-1).indices
    cap = expert_capacity(1.0, s, k, e)
    keep = capacity_keep_mask(idx, cap, e)
    assert torch.equal(keep, capacity_keep_mask(idx.clone(), cap, e))
    # splitting the batch (data parallelism, micro-batches) changes nothing
    assert torch.equal(torch.cat([capacity_keep_mask(idx[:2], cap, e), capacity_keep_mask(idx[2:], cap, e)]), keep)
    for seq in range(b):  # each expert keeps at most `cap` slots per sequence, the earliest ones
        for ex in range(e):
            hits = (idx[seq] == ex)
            kept = hits & keep[seq]
            assert kept.sum() == min(cap, hits.sum())
            if kept.sum() < hits.sum():
                last_kept = kept.any(-1).nonzero().max()
                first_dropped = (hits & ~keep[seq]).any(-1).nonzero().min()
                assert last_kept < first_dropped


def test_sharded_capacity_without_cp_is_plain():
    ctx = ParallelContext.single()
    idx = torch.randint(0, 4, (2, 8, 1))
    assert torch.equal(sharded_capacity_keep_mask(idx, 2, 4, ctx.cp, None), capacity_keep_mask(idx, 2, 4))


def test_bad_router_inputs():
    ctx = ParallelContext.single()
    with pytest.raises(ValueError, match="moe_top_k=9 must be in"):
        Router(16, 8, 9, ctx.tp)
    with pytest.raises(ValueError, match="router_score"):
        Router(16, 8, 2, ctx.tp, score="relu")
    with pytest.raises(ValueError, match="num_experts must be positive"):
        Router(16, 0, 1, ctx.tp)


def test_bias_buffer_survives_dtype_and_device_moves():
    r = _router().to(torch.bfloat16)
    assert r.weight.dtype == torch.bfloat16
    assert r.expert_bias.dtype == torch.float32 and r.expert_bias.meta.global_shape == (8,)
    out = r(torch.randn(4, 16, dtype=torch.bfloat16))
    assert out.weights.dtype == torch.float32
