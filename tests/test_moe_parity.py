"""MoE parity against world size 1 (gloo): expert, data, tensor and context parallel layouts give the same
loss (auxiliary terms included), gradients, weights after 3 AdamW steps, expert loads and dropped tokens."""
import pytest
import torch

from parallel3d.models.config import ModelConfig
from parallel3d.models.moe import MoETransformer
from parallel3d import comm
from parallel3d.context_parallel import cp_chunk_indices, shard_sequence
from parallel3d.data_parallel.grads import reduce_gradients
from parallel3d.mesh import MeshSpec, ParallelContext
from parity import PARITY_ADAM, WEIGHT_ATOL, assemble, assert_close_dicts, local_slices

STEPS, BATCH, SEQ = 3, 4, 16

MIXTRAL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
               num_experts=4, moe_top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001, max_seq_len=32, init_std=0.1)
DEEPSEEK = dict(MIXTRAL, num_experts=8, moe_top_k=3, moe_ffn_hidden_size=16, num_shared_experts=1,
                first_k_dense=1, router_score="sigmoid", router_bias_update_rate=0.05, aux_loss_coef=0.001)


def train(ctx: ParallelContext, model_kwargs: dict, sp: bool, recompute: str = "none", seed: int = 5):
    cfg = ModelConfig(**model_kwargs)
    model = MoETransformer(cfg, ctx, sequence_parallel=sp, recompute=recompute)
    model.init_weights(seed)
    opt = torch.optim.AdamW(model.parameters(), **PARITY_ADAM)
    g = torch.Generator().manual_seed(seed)
    dp, dp_r, cp, cp_r = ctx.spec.dp, ctx.coords.dp, ctx.spec.cp, ctx.coords.cp
    rows = slice(dp_r * BATCH // dp, (dp_r + 1) * BATCH // dp)  # this rank's sequences of the global batch
    positions = cp_chunk_indices(SEQ, cp, cp_r)  # (s/cp,) load-balanced CP shard
    losses, grads, loads = [], None, []
    for step in range(STEPS):
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=g)[rows]
        ids, labels = (shard_sequence(t, cp, cp_r) for t in (tokens[:, :-1], tokens[:, 1:]))  # (b, s/cp)
        opt.zero_grad()
        loss = model(ids, positions, labels) / (BATCH * SEQ)
        loss.backward()
        reduce_gradients(model.parameters(), ctx)
        if step == 0:
            grads = local_slices(model, "grad")
        opt.step()
        stats = model.moe_load_stats()  # once per step: telemetry, bias update, reset
        loads.append({k: v for k, v in stats.items() if "per_expert" in k})
        losses.append(comm.all_reduce(loss.detach().clone(), ctx.dp_cp).item())
    biases = {i: m.router.expert_bias.clone() for i, m in model.moe_layers().items()}
    return losses, grads, local_slices(model, "data"), loads, biases


def _worker(w, spec_kwargs, model_kwargs, sp, recompute="none"):
    return train(w.context(MeshSpec(**spec_kwargs)), model_kwargs, sp, recompute)


CASES = [  # (id, world, mesh, model, sp)
    ("ep2", 2, dict(dp=2, ep=2), MIXTRAL, False),
    ("ep4", 4, dict(dp=4, ep=4), MIXTRAL, False),
    ("ep2-edp2-deepseek", 4, dict(dp=4, ep=2), DEEPSEEK, False),
    ("ep4-deepseek-capacity", 4, dict(dp=4, ep=4), dict(DEEPSEEK, capacity_factor=1.0), False),
    ("tp2-ep2-sp", 4, dict(tp=2, dp=2, ep=2), MIXTRAL, True),
    ("tp2-sp", 2, dict(tp=2), MIXTRAL, True),  # sp_dispatch.py without an EP exchange
    ("tp2-sp-deepseek-capacity", 2, dict(tp=2), dict(DEEPSEEK, capacity_factor=1.0), True),
    ("tp2-ep2-sp-deepseek-capacity", 4, dict(tp=2, dp=2, ep=2), dict(DEEPSEEK, capacity_factor=1.25), True),
    ("tp2-cp2-ep2-sp-capacity", 4, dict(tp=2, cp=2, ep=2), dict(MIXTRAL, capacity_factor=1.0), True),
    ("tp2-ep2-deepseek-capacity", 4, dict(tp=2, dp=2, ep=2), dict(DEEPSEEK, capacity_factor=1.25), False),
    ("cp2-ep2-capacity", 2, dict(cp=2, ep=2), dict(MIXTRAL, capacity_factor=1.0), False),
    ("cp2-dp2-ep4-deepseek-capacity", 4, dict(cp=2, dp=2, ep=4), dict(DEEPSEEK, capacity_factor=1.0), False),
    # parallel folding (mesh_spec.py): EP over TP x CP x DP ranks, whole experts (etp=1) or etp-split ones;
    # CI: the no-SP split order (split_forward) with capacity, etp over DP ranks, 1 < etp < tp (the Trainer
    # runs the SP folds: tests/test_moe_folding.py)
    ("tp2-dp2-etp1-ep4-capacity", 4, dict(tp=2, dp=2, ep=4), dict(MIXTRAL, capacity_factor=1.0), False),
    ("dp4-etp2-ep2", 4, dict(dp=4, ep=2, etp=2), DEEPSEEK, False),  # etp over DP ranks (etp > tp)
    ("tp4-etp2-ep2-deepseek", 4, dict(tp=4, ep=2, etp=2), DEEPSEEK, False),
    ("tp2-dp2-etp1-ep4-sp", 4, dict(tp=2, dp=2, ep=4), DEEPSEEK, True),
    ("tp2-dp2-etp2-ep2-sp-deepseek", 4, dict(tp=2, dp=2, ep=2, etp=2), DEEPSEEK, True),  # the layout before folding
    ("tp2-cp2-etp1-ep4-sp-capacity", 4, dict(tp=2, cp=2, ep=4), dict(MIXTRAL, capacity_factor=1.0), True),
    ("tp4-etp2-ep2-sp", 4, dict(tp=4, ep=2, etp=2), MIXTRAL, True),
]
SWEEP = {"tp2-dp2-etp1-ep4-sp", "tp2-dp2-etp2-ep2-sp-deepseek", "tp2-cp2-etp1-ep4-sp-capacity", "tp4-etp2-ep2-sp"}


@pytest.mark.parametrize("world,mesh,model_kwargs,sp", [
    pytest.param(*c[1:], id=c[0], marks=pytest.mark.sweep if c[0] in SWEEP else ()) for c in CASES])
def test_moe_parity(worlds, world, mesh, model_kwargs, sp):
    ref_losses, ref_grads, ref_weights, ref_loads, ref_bias = train(ParallelContext.single(), model_kwargs, False)
    results = worlds.run(world, _worker, mesh, model_kwargs, sp)
    _compare(results, ref_losses, ref_grads, ref_weights, ref_loads, ref_bias, model_kwargs)


@pytest.mark.parametrize("world,mesh,model_kwargs,sp", [
    (2, dict(dp=2, ep=2), dict(MIXTRAL, capacity_factor=1.0), False),
    (4, dict(tp=2, dp=2, ep=2), dict(DEEPSEEK, capacity_factor=1.0), True),  # the TP counts replayed too
], ids=["ep2", "tp2-ep2-sp-deepseek"])
def test_moe_parity_full_recompute(worlds, world, mesh, model_kwargs, sp):
    """Activation recomputation re-runs routing, all-to-alls and the aux all-reduce inside backward."""
    ref = train(ParallelContext.single(), model_kwargs, False)
    results = worlds.run(world, _worker, mesh, model_kwargs, sp, "full")
    _compare(results, *ref, model_kwargs)


def _compare(results, ref_losses, ref_grads, ref_weights, ref_loads, ref_bias, model_kwargs):
    for losses, _, _, loads, biases in results:
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
        assert loads == ref_loads  # same expert loads, same dropped slots, every step
        for i, bias in biases.items():
            torch.testing.assert_close(bias, ref_bias[i])
    if model_kwargs.get("capacity_factor"):
        assert any(sum(v) for step in ref_loads for k, v in step.items() if "dropped" in k), "nothing was dropped"
    if model_kwargs.get("router_bias_update_rate"):
        assert any(b.abs().sum() > 0 for b in ref_bias.values())
    assert_close_dicts(assemble([r[1] for r in results]), {n: t for n, (t, _, _) in ref_grads.items()},
                       what="grad")
    assert_close_dicts(assemble([r[2] for r in results]), {n: t for n, (t, _, _) in ref_weights.items()},
                       atol=WEIGHT_ATOL, what="weight")
