"""Data-parallel parity (ZeRO 0-3, gradient accumulation, TP x DP) against world size 1, token-normalised
loss and per-step communication volume. The helpers here (`reference`, `train`) are shared with
test_precision.py, test_grad_clip.py and test_zero_memory.py.

Data: a global batch of B sequences per step, the same for every layout. DP rank r takes the contiguous
block [r*B/dp, (r+1)*B/dp) and cuts it into `acc` microbatches; every loss is a sum of token losses
divided by the number of target tokens in the global batch (B*S), so gradients are summed over DP.
"""
from __future__ import annotations

from typing import Optional

import pytest
import torch

from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Llama
from parallel3d.data_parallel import DataParallelConfig, attach
from parallel3d.mesh import ParallelContext
from parallel3d.mesh import MeshSpec
from parity import PARITY_ADAM, WEIGHT_ATOL, assemble, assert_close_dicts, assert_grad_norms, double_every_gradient

BASE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
            kernels="torch")
B, S, STEPS, SEED = 16, 16, 3, 7
OPT = dict(lr=PARITY_ADAM["lr"], eps=PARITY_ADAM["eps"], weight_decay=PARITY_ADAM["weight_decay"],
           betas=(0.9, 0.999))


def global_batches(vocab: int, steps: int = STEPS, b: int = B, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (b, S + 1), generator=g) for _ in range(steps)]


def reference(model_kwargs: dict, clip: float = 0.0, steps: int = STEPS, model_cls: type = Llama) -> dict:
    """World size 1: plain torch model, torch.optim.AdamW (norm weights without decay), whole batch."""
    cfg = ModelConfig(**model_kwargs)
    model = model_cls(cfg, ParallelContext.single())
    model.init_weights(SEED)
    decay = [p for p in model.parameters() if p.dim() != 1]
    no_decay = [p for p in model.parameters() if p.dim() == 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], **PARITY_ADAM)
    out = {"losses": [], "norms": []}
    for step, tokens in enumerate(global_batches(cfg.vocab_size, steps)):
        opt.zero_grad()
        loss = model(tokens[:, :-1], torch.arange(S), tokens[:, 1:]) / tokens[:, 1:].numel()
        loss.backward()
        if step == 0:
            out["grads"] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        out["norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else 1e30)))
        opt.step()
        out["losses"].append(loss.item())
    out["weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out


def train(ctx: ParallelContext, model_kwargs: dict, zero: int, acc: int, sp: bool = False, clip: float = 0.0,
          precision: str = "fp32", steps: int = STEPS, bucket_mb: float = 0.004,
          inject_inf_step: Optional[int] = None, inject_shard_step: Optional[int] = None,
          opt_kwargs: Optional[dict] = None, repeat: bool = False, chunks: bool = False, start: int = 0,
          load: Optional[dict] = None, model_cls: type = Llama, model_opts: Optional[dict] = None) -> dict:
    """Train steps [start, steps) with DistributedOptimizer; returns this rank's losses, norms, grads, weights.

    repeat: every step uses the first global batch (a loss that must fall). inject_inf_step: the last
    rank's loss is multiplied by inf at that step. inject_shard_step: the last rank alone poisons one
    element of its *reduced* gradient shard (no reduction spreads it: the skip must come from the flag).
    chunks: the model is two chunks on this rank (virtual-pipeline style: [embed, layer 0] and
    [layer 1, norm, head]). load: {"tensors": {name: global tensor}, "scalar": {...}} to resume from.
    model_cls / model_opts: the model class (Llama or MoETransformer) and extra constructor options."""
    cfg = ModelConfig(**model_kwargs)
    mo = dict(model_opts or {}, sequence_parallel=sp)
    dev = ctx.device   # the rank's GPU on NCCL: parameters are created where they live, as the Trainer does
    with torch.device(dev):
        if chunks:
            models = [model_cls(cfg, ctx, layers=[0], post=False, **mo),
                      model_cls(cfg, ctx, layers=[1], pre=False, **mo)]
        else:
            models = [model_cls(cfg, ctx, **mo)]
    for m in models:
        m.init_weights(SEED)
    named = {n: p for m in models for n, p in m.named_parameters()}
    opt = attach(models, ctx, DataParallelConfig(zero=zero, precision=precision, bucket_size_mb=bucket_mb,
                                                 **{**OPT, **(opt_kwargs or {})}))
    if load is not None:
        opt.load_state_tensors(lambda name, sl: load["tensors"][name][sl])
        opt.load_scalar_state(load["scalar"])

    def forward(ids, labels):
        x = ids
        for m in models[:-1]:
            x = m(x, torch.arange(S, device=dev))
        return models[-1](x, torch.arange(S, device=dev), labels)

    dp, r = ctx.spec.dp, ctx.coords.dp
    out = {"losses": [], "norms": [], "ok": [], "scales": [], "tp": ctx.coords.tp}
    batches = global_batches(cfg.vocab_size, 1 if repeat else steps)
    for step in range(start, steps):
        tokens = batches[0 if repeat else step]
        per = tokens.shape[0] // dp
        mine = tokens[r * per: (r + 1) * per].to(dev)
        opt.zero_grad()
        total = 0.0
        for i, mb in enumerate(mine.chunk(acc)):
            opt.set_last_microbatch(i == acc - 1)
            loss = forward(mb[:, :-1], mb[:, 1:]) / tokens[:, 1:].numel()
            if inject_inf_step == step and ctx.rank == ctx.world_size - 1:
                loss = loss * float("inf")
            opt.scale_loss(loss).backward()
            total += loss.item()
        opt.finish_grad_sync()
        if step == start:
            out["grads"] = opt.grad_slices()
        if inject_shard_step == step and ctx.rank == ctx.world_size - 1:
            opt.buckets[-1].grad.shard[0] = float("nan")
        out["norms"].append(opt.clip_grad_norm(clip))
        out["scales"].append(opt.loss_scale)
        out["ok"].append(opt.step(OPT["lr"]))
        out["losses"].append(total)
    out["state"] = {k: (t.clone(), sl, shape) for k, (t, shape, sl) in opt.state_tensors().items()}
    out["scalar"] = opt.scalar_state()
    out["weights"] = {k[len("master/"):]: v for k, v in out["state"].items() if k.startswith("master/")}
    if zero < 3 and precision == "fp32":  # the model's parameters are the master weights
        for key, (t, sl, _) in out["weights"].items():
            p = named[key.split("#")[0]]   # "name#2": a further box of this rank's range of the parameter
            local = p.data[tuple(slice(g.start - m.start, g.stop - m.start) for g, m in zip(sl, p.meta.slices))]
            assert torch.equal(local, t), key
    out["stats"] = ctx.stats.summary()
    out["memory"] = opt.memory_bytes()
    return _on_host(out)


def _on_host(obj):
    """Tensors copied to the CPU (a GPU rank's results travel to the test process, which compares on CPU)."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, dict):
        return {k: _on_host(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_on_host(v) for v in obj)
    return obj


# ---- parity ----------------------------------------------------------------------------------------------
def _worker(w, tp, zero, acc, sp, chunks=False):
    ctx = w.context(MeshSpec(tp=tp, dp=w.world_size // tp))
    return train(ctx, BASE, zero, acc, sp=sp, chunks=chunks)


def check_parity(results: list[dict], ref: dict) -> None:
    losses = [sum(x) for x in zip(*[r["losses"] for r in results if r["tp"] == 0])]
    for a, b in zip(losses, ref["losses"]):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, ref["losses"])
    assert_grad_norms([r["norms"] for r in results], ref["norms"], rtol=1e-5)
    grads, weights = assemble([r["grads"] for r in results]), assemble([r["weights"] for r in results])
    assert set(grads) == set(weights) == set(ref["grads"])
    assert_close_dicts(grads, ref["grads"], what="grad")
    assert_close_dicts(weights, ref["weights"], atol=WEIGHT_ATOL, what="weight")


def test_doubled_gradients_fail_check_parity(monkeypatch, ref):
    """Mutant: every gradient doubled (DistributedOptimizer.scale_loss) at world size 1: check_parity fails (this
    harness trains without clipping, so Adam's eps lets the later losses see the scale; the grad norm and the
    first step's gradients, compared directly, see it anyway)."""
    check_parity([train(ParallelContext.single(), BASE, 0, 1)], ref)  # the clean run passes
    double_every_gradient(monkeypatch)
    mutant = train(ParallelContext.single(), BASE, 0, 1)
    with pytest.raises(AssertionError):
        check_parity([mutant], ref)
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_grad_norms([mutant["norms"]], ref["norms"], rtol=1e-5)


# every ZeRO stage at dp 2 and 4, accumulation 1 and 4; then tp=2 x dp=2 with ZeRO-1 and ZeRO-3
CASES = [(1, 2, 0, 1, False), (1, 2, 1, 4, False), (1, 2, 2, 1, False), (1, 2, 3, 4, False),
         (1, 4, 0, 4, False), (1, 4, 1, 1, False), (1, 4, 2, 4, False), (1, 4, 3, 1, False),
         (2, 2, 1, 2, True), (2, 2, 3, 1, False)]


@pytest.fixture(scope="module")
def ref():
    return reference(BASE)


@pytest.mark.parametrize("tp,dp,zero,acc,sp", CASES, ids=[f"tp{c[0]}-dp{c[1]}-zero{c[2]}-acc{c[3]}-sp{int(c[4])}"
                                                           for c in CASES])
def test_dp_parity(worlds, ref, tp, dp, zero, acc, sp):
    check_parity(worlds.run(tp * dp, _worker, tp, zero, acc, sp), ref)


@pytest.mark.parametrize("zero", [1, 3])
def test_dp_parity_model_chunks(worlds, ref, zero):
    """Two model chunks per rank (as with virtual pipeline stages): the optimizer only assumes its list."""
    check_parity(worlds.run(2, _worker, 1, zero, 2, False, True), ref)


def _resume(w, tp, zero, steps, start, load):
    return train(w.context(MeshSpec(tp=tp, dp=w.world_size // tp)), BASE, zero, 1, steps=steps, start=start,
                 load=load)


def test_state_tensors_reshard(worlds, ref):
    """Optimizer state saved under tp=2 x dp=2 ZeRO-1 after 2 steps, resumed under dp=4 ZeRO-3 and
    dp=2 ZeRO-0: the third step lands on the world-size-1 weights. state_tensors tile every tensor once."""
    saved = worlds.run(4, _resume, 2, 1, 2, 0, None)
    tensors: dict = {}
    for r in saved:
        for name, (t, sl, shape) in r["state"].items():
            full = tensors.setdefault(name, torch.full(shape, float("nan")))
            assert torch.isnan(full[sl]).all(), f"{name}: {sl} returned by two ranks"
            full[sl] = t
    assert all(not torch.isnan(t).any() for t in tensors.values())
    load = {"tensors": tensors, "scalar": saved[0]["scalar"]}
    assert load["scalar"]["step"] == 2
    for world, tp, zero in [(4, 1, 3), (2, 1, 0), (4, 2, 2)]:
        results = worlds.run(world, _resume, tp, zero, 3, 2, load)
        assert_close_dicts(assemble([r["weights"] for r in results]), ref["weights"], atol=WEIGHT_ATOL,
                           what=f"resumed zero{zero}")


MOE = dict(BASE, num_experts=4, moe_top_k=2, aux_loss_coef=0.01, z_loss_coef=0.001, max_seq_len=32, init_std=0.1)


def _moe(w, spec, zero, acc):
    from parallel3d.models.moe import MoETransformer
    return train(w.context(MeshSpec(**spec)), MOE, zero, acc, model_cls=MoETransformer)


@pytest.mark.parametrize("zero", [1, 3])
def test_dp_parity_moe_expert_dp(worlds, zero):
    """Expert weights live in their own buckets, reduced and sharded over expert-DP (dp=4, ep=2: edp=2).
    One microbatch: the auxiliary balancing loss is a statistic of the whole microbatch."""
    from parallel3d.models.moe import MoETransformer
    check_parity(worlds.run(4, _moe, dict(dp=4, ep=2), zero, 1), reference(MOE, model_cls=MoETransformer))


def _recompute(w, zero):
    return train(w.context(MeshSpec(dp=w.world_size)), BASE, zero, 2, model_opts=dict(recompute="full"))


def test_zero3_full_recompute(worlds, ref):
    """Activation recomputation re-enters a ZeRO-3 unit's forward inside backward."""
    check_parity(worlds.run(2, _recompute, 3), ref)


def _loss_only(w, acc):
    ctx = w.context(MeshSpec(dp=w.world_size))
    return train(ctx, BASE, 0, acc, steps=1)["losses"][0]


def test_token_normalised_loss(worlds):
    """Same global batch, same loss whatever the dp x accumulation split."""
    ref_loss = reference(BASE, steps=1)["losses"][0]
    for dp, acc in [(2, 1), (2, 8), (4, 2)]:
        total = sum(worlds.run(dp, _loss_only, acc))
        assert abs(total - ref_loss) <= 1e-5 * ref_loss, (dp, acc, total, ref_loss)


# ---- communication volume ------------------------------------------------------------------------------
def _volume(w, zero):
    ctx = w.context(MeshSpec(dp=w.world_size))
    cfg = ModelConfig(**BASE)
    model = Llama(cfg, ctx)
    model.init_weights(SEED)
    opt = attach([model], ctx, DataParallelConfig(zero=zero, bucket_size_mb=0.004, **OPT))
    tokens = global_batches(cfg.vocab_size, 1)[0]
    per = tokens.shape[0] // w.world_size
    mine = tokens[w.rank * per: (w.rank + 1) * per]
    ctx.stats.reset()
    opt.zero_grad()
    (model(mine[:, :-1], torch.arange(S), mine[:, 1:]) / tokens[:, 1:].numel()).backward()
    opt.finish_grad_sync()
    opt.clip_grad_norm(1.0)
    opt.step(1e-3)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    padded = sum(b.numel * 4 for b in opt.buckets)
    unpadded = [sum(s.numel for s in b.slots) for b in opt.buckets]
    return ctx.stats.summary(), nbytes, padded, len(opt.buckets), unpadded


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_comm_volume(worlds, zero):
    """Per step, in comm's convention (all_reduce: tensor bytes; reduce_scatter: input bytes;
    all_gather: output bytes), P = parameter bytes (fp32), P' = P with padding: ZeRO-1/2, each bucket's
    parameters rounded up to a multiple of dp x 64 elements (buffer.ALIGN), ZeRO-0 none; ZeRO-3, to whole dim-0 chunks:
      zero 0: all_reduce(dp_cp) = P             (a ring all-reduce moves 2x that: same as below)
      zero 1/2: reduce_scatter = all_gather = P' (together 2P')
      zero 3: all_gather = 2P' (forward + backward), reduce_scatter = P'   (3P' = 1.5x DP)
    plus one 16-byte world all-reduce ([sum of squares, overflow flag])."""
    for stats, p, padded, buckets, unpadded in worlds.run(2, _volume, zero):
        assert buckets > 2  # bucket_size_mb=0.004: several buckets, one reduction each
        assert stats.pop(("world", "all_reduce")) == (1, 16)
        assert sum(unpadded) * 4 == p
        if zero == 3:
            assert padded == p  # this model's dim-0 sizes are divisible by 2: no padding
        else:  # contiguous buckets: padding only at each bucket's end
            quantum = 1 if zero == 0 else 2 * 64
            assert padded == sum(-(-n // quantum) * quantum * 4 for n in unpadded)
        if zero == 0:
            assert stats == {("dp_cp", "all_reduce"): (buckets, p)}
        elif zero in (1, 2):
            assert stats[("dp_cp", "reduce_scatter")] == (buckets, padded)
            assert stats[("dp_cp", "all_gather")] == (buckets, padded)
            assert set(stats) == {("dp_cp", "reduce_scatter"), ("dp_cp", "all_gather")}
        else:
            assert stats[("dp_cp", "reduce_scatter")] == (buckets, padded)
            assert stats[("dp_cp", "all_gather")][1] == 2 * padded
            assert set(stats) == {("dp_cp", "reduce_scatter"), ("dp_cp", "all_gather")}


# ---- overlap and ZeRO-3 gather/free schedule -------------------------------------------------------------
def _schedule(w, zero, unused):
    ctx = w.context(MeshSpec(dp=w.world_size))
    model = Llama(ModelConfig(**BASE), ctx)
    model.init_weights(SEED)
    if unused:  # a parameter that never gets a gradient, in the middle of the bucket order
        model.layers["0"].unused = torch.nn.Parameter(torch.zeros(8))
    opt = attach([model], ctx, DataParallelConfig(zero=zero, bucket_size_mb=0.004, **OPT))
    seen = []
    if zero == 3:
        units = opt.zero3.units
        for i, blk in enumerate(model.layers.values()):
            blk.register_forward_pre_hook(lambda m, a, i=i: seen.append(
                (i, [u.gathered for u in units], [u.pending is not None for u in units])))
    tokens = global_batches(BASE["vocab_size"], 1)[0][:4]
    launched, in_backward = [], []
    for p in model.parameters():  # runs after the optimizer's own hook: sees launches made inside backward
        p.register_post_accumulate_grad_hook(lambda p: in_backward[-1].append(sum(b.grad.launched for b in opt.buckets)))
    opt.zero_grad()
    for i, mb in enumerate(tokens.chunk(2)):
        opt.set_last_microbatch(i == 1)
        in_backward.append([])
        (model(mb[:, :-1], torch.arange(S), mb[:, 1:]) / 64).backward()
        launched.append(sum(b.grad.launched for b in opt.buckets))
        if zero == 3:
            seen.append(("after backward", [u.gathered for u in opt.zero3.units]))
    opt.finish_grad_sync()
    return launched, [max(x, default=0) for x in in_backward], len(opt.buckets), seen


@pytest.mark.parametrize("unused", [False, True])
@pytest.mark.parametrize("zero", [1, 3])
def test_reduction_overlaps_backward_and_zero3_frees(worlds, zero, unused):
    """Buckets reduce inside backward: ZeRO-1 only on the last microbatch, ZeRO-3 in every one (its buffers
    are freed after each reduction, sync.py); a parameter without gradient does not hold its bucket back
    past the end of backward (nor keep its ZeRO-3 unit gathered)."""
    launched, during, n_buckets, seen = worlds.run(2, _schedule, zero, unused)[0]
    assert n_buckets > 2
    if zero == 1:
        assert during[0] == 0 and launched[0] == 0   # accumulation: nothing reduced on microbatch 0
    else:       # reduced in microbatch 0's backward too; its buckets start over for the next one
        assert (0 < during[0] < n_buckets) if unused else during[0] >= n_buckets - 1
        assert launched[0] == 0
    if unused:  # the bucket holding the unused parameter (and those after it) wait for the end of backward
        assert 0 < during[1] < n_buckets
    else:       # reductions overlap backward: all but the last bucket launched while gradients still arrive
        assert during[1] >= n_buckets - 1
    assert launched[1] == n_buckets  # by the end of backward, not only at finish_grad_sync
    if zero == 3:  # units: [root, block0, block1]; entering block i's forward: root + block i gathered,
        # block i+1 prefetched, block i-1 freed; after each backward nothing stays gathered
        fwd = [s for s in seen if s[0] in (0, 1)]
        assert fwd[0] == (0, [True, True, False], [False, False, True])
        assert fwd[1] == (1, [True, False, True], [False, False, False])
        assert all(s[1] == [False, False, False] for s in seen if s[0] == "after backward")
