"""Pipeline-parallel Llama parity against world size 1: loss, gradients and (some) AdamW weights.

Each case runs the trainer's flow on gloo ranks: chunks = Llama(layers of global stage c*pp + r)
per local chunk c, ``run_pipeline_step`` over m microbatches, ``reduce_gradients``, AdamW. The
reference is one plain Llama over the same m microbatches with loss = sum of token losses / tokens.
The cases cover every schedule on pp=2 and pp=4, m in {1, p, 2p+1}, tied and untied embeddings,
layer counts pp does not divide (an empty last stage on pp=4), tp=2 x pp=2 with and without
sequence parallelism, cp=2 x pp=2 and dp=2 x pp=2; the full cross product would take minutes on
two cores.
"""
from __future__ import annotations

import pytest
import torch

from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Llama
from parallel3d.context_parallel.sharding import cp_chunk_indices, shard_sequence
from parallel3d.data_parallel.grads import reduce_gradients
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.pipeline.partition import partition_layers
from parallel3d.pipeline.runtime import PipelineStats, run_pipeline_forward, run_pipeline_step
from parity import PARITY_ADAM, WEIGHT_ATOL, assemble, assert_close_dicts, local_slices

B, S, SEED = 2, 16, 7
BASE = dict(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48)


def batches(cfg: ModelConfig, m: int, steps: int) -> list[list[dict]]:
    """The same global batch on every rank: steps x m microbatches of (B, S) tokens."""
    g = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (m, B, S + 1), generator=g)
        out.append([{"ids": t[:, :-1], "labels": t[:, 1:], "position_ids": torch.arange(S)}
                    for t in tokens])
    return out


def reference(kwargs: dict, m: int, steps: int):
    cfg = ModelConfig(**kwargs)
    model = Llama(cfg, ParallelContext.single())
    model.init_weights(SEED)
    opt = torch.optim.AdamW(model.parameters(), **PARITY_ADAM)
    losses, grads = [], None
    for step, mbs in enumerate(batches(cfg, m, steps)):
        opt.zero_grad()
        total = 0.0
        for mb in mbs:
            loss = model(mb["ids"], mb["position_ids"], mb["labels"]) / (m * B * S)
            loss.backward()
            total += loss.item()
        losses.append(total)
        if step == 0:
            grads = {n: t for n, (t, _, _) in local_slices(model, "grad").items()}
        opt.step()
    return losses, grads, {n: t for n, (t, _, _) in local_slices(model, "data").items()}


def shard(mbs: list[dict], ctx: ParallelContext) -> list[dict]:
    """This rank's share of each microbatch: rows by DP rank, load-balanced sequence chunks by CP
    rank (as the trainer's data path does)."""
    dp, cp = ctx.dp.size, ctx.cp.size
    rows = [{k: mb[k][ctx.dp.rank::dp] for k in ("ids", "labels")} for mb in mbs]
    if cp == 1:
        return [{**r, "position_ids": torch.arange(S)} for r in rows]
    return [{"ids": shard_sequence(r["ids"], cp, ctx.cp.rank),
             "labels": shard_sequence(r["labels"], cp, ctx.cp.rank),
             "position_ids": cp_chunk_indices(S, cp, ctx.cp.rank)} for r in rows]


def _worker(w, kwargs: dict, layout: tuple, schedule: str, m: int, steps: int, sp: bool):
    tp, cp, dp, pp = layout
    ctx = w.context(MeshSpec(tp=tp, cp=cp, dp=dp, pp=pp))
    cfg = ModelConfig(**kwargs)
    v = 2 if schedule == "interleaved" else 1
    stages = partition_layers(cfg.num_layers, pp, v)
    ids = [c * pp + ctx.coords.pp for c in range(v)]
    chunks = [Llama(cfg, ctx, layers=stages[s], pre=s == 0, post=s == pp * v - 1,
                    sequence_parallel=sp) for s in ids]
    for chunk in chunks:
        chunk.init_weights(SEED)
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.AdamW(params, **PARITY_ADAM)
    hooked: list[int] = []
    for p in params:  # the optimizer's overlap relies on these firing once per accumulation
        p.register_post_accumulate_grad_hook(lambda _: hooked.append(1))
    for chunk in chunks:
        chunk.eval()
    evaluated = run_pipeline_forward(ctx, chunks, shard(batches(cfg, m, 1)[0], ctx)).item()
    for chunk in chunks:
        chunk.train()
    losses, grads, stats = [], {}, PipelineStats()
    for step, mbs in enumerate(batches(cfg, m, steps)):
        opt.zero_grad()
        loss = run_pipeline_step(ctx, chunks, schedule, shard(mbs, ctx), loss_scale=1.0 / (m * B * S),
                                 backward=lambda loss: loss.backward(), stats=stats)
        losses.append(loss.item())
        reduce_gradients(params, ctx)
        if step == 0:
            grads = {k: v for c in chunks for k, v in local_slices(c, "grad").items()}
        opt.step()
    weights = {k: v for c in chunks for k, v in local_slices(c, "data").items()}
    counted = ctx.is_last_stage and ctx.coords.tp == 0  # TP repeats the loss, DP and CP split it
    return losses, grads, weights, evaluated, len(hooked) / (len(params) * m * steps), counted


CASES = [  # ((tp, cp, dp, pp), schedule, m, steps, sp, model overrides)
    ((1, 1, 1, 2), "gpipe", 1, 1, False, dict(num_layers=2)),
    ((1, 1, 1, 2), "1f1b", 2, 3, False, dict(num_layers=5, tie_embeddings=True)),  # 5 on 2 stages
    ((1, 1, 1, 2), "zb-h1", 5, 1, False, dict(num_layers=3)),
    ((1, 1, 1, 2), "interleaved", 4, 3, False, dict(num_layers=4, tie_embeddings=True)),
    ((1, 1, 1, 4), "gpipe", 4, 1, False, dict(num_layers=4)),
    ((1, 1, 1, 4), "1f1b", 9, 1, False, dict(num_layers=3, tie_embeddings=True)),  # empty last stage
    ((1, 1, 1, 4), "zb-h1", 9, 3, False, dict(num_layers=4, tie_embeddings=True)),
    ((1, 1, 1, 4), "zb-h1", 1, 1, False, dict(num_layers=4)),
    ((1, 1, 1, 4), "interleaved", 4, 1, False, dict(num_layers=6)),
    ((2, 1, 1, 2), "1f1b", 3, 1, False, dict(num_layers=3)),
    ((2, 1, 1, 2), "interleaved", 2, 3, True, dict(num_layers=4, tie_embeddings=True)),
    ((2, 1, 1, 2), "zb-h1", 3, 1, True, dict(num_layers=2)),
    ((1, 2, 1, 2), "1f1b", 3, 1, False, dict(num_layers=3)),  # context parallel: s_local = s / cp
    ((1, 1, 2, 2), "zb-h1", 2, 1, False, dict(num_layers=2, tie_embeddings=True)),
]


def _id(case) -> str:
    (tp, cp, dp, pp), schedule, m, steps, sp, over = case
    tied = "-tied" if over.get("tie_embeddings") else ""
    return (f"tp{tp}-cp{cp}-dp{dp}-pp{pp}-{schedule}-m{m}-L{over['num_layers']}{tied}"
            f"{'-sp' if sp else ''}")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_pipeline_parity(worlds, case):
    layout, schedule, m, steps, sp, overrides = case
    kwargs = {**BASE, **overrides}
    ref_losses, ref_grads, ref_weights = reference(kwargs, m, steps)
    tp, cp, dp, pp = layout
    results = worlds.run(tp * cp * dp * pp, _worker, kwargs, layout, schedule, m, steps, sp)
    counted = [r for r in results if r[-1]]  # the last stage's ranks hold the loss
    for i, want in enumerate(ref_losses):
        got = sum(r[0][i] for r in counted)
        assert abs(got - want) <= 1e-5 * abs(want), (i, got, want)
    evaluated = sum(r[3] for r in counted) / (m * B * S)
    assert abs(evaluated - ref_losses[0]) <= 1e-5 * ref_losses[0]
    for losses, _, _, evaluated, _, _ in results[:-tp * cp * dp]:  # earlier stages report zero
        assert losses == [0.0] * steps and evaluated == 0.0
    # every parameter's post-accumulate-grad hook (the optimizer's overlap) fired once per microbatch
    assert all(hooks == 1 for *_, hooks, _ in results)

    def check(per_rank: list[dict], ref: dict, what: str, atol: float) -> None:
        got = assemble(per_rank)
        if kwargs.get("tie_embeddings"):  # the last stage's copy of the tied embedding
            head = got.pop("lm_head.weight")
            torch.testing.assert_close(head, ref["embed.weight"], rtol=1e-4, atol=atol)
        assert set(got) == set(ref), f"{what}: names differ {set(got) ^ set(ref)}"
        assert_close_dicts(got, ref, atol=atol, what=what)

    check([r[1] for r in results], ref_grads, "grad", 1e-6)
    if steps > 1:
        check([r[2] for r in results], ref_weights, "weight", WEIGHT_ATOL)
