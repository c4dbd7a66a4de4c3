"""Runtime overhead work of the pipeline runtime (issue 20, item 3): receives posted one group early and
waited by the compute that reads them, stage outputs freed once sent, the same numbers as before.

- pure: the early plan (runtime_schedules.rank_plan) moves every receive before the compute that precedes
  its group, keeps sends in place and every per-peer order, for every schedule;
- DualPipe-V's pairs (issue 30 item 4): in each (F, B) pair of two microbatches the F's outgoing sends are
  posted after the F and before the B's compute, the B's receives before the F's compute and waited after it,
  so each one's pipeline messages travel while the other computes (plan: every size; gloo: the trace);
- gloo: the runtime really posts in that order (PipelineStats.trace), gives gradients bit-identical to the
  strict run (groups posted and waited whole, as scheduled), and a sent output's storage is gone by the
  time its backward runs (only the gradient edge is kept);
- the real Trainer under the loop schedules with activation checkpointing, tied embeddings and MoE
  auxiliary losses matches world size 1 (the V schedules: test_pipeline_vshape_trainer.py).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Llama
from parallel3d.mesh import MeshSpec
from parallel3d.pipeline import (SCHEDULE_NAMES, ActionKind as K, build_schedule, chunks_per_rank, locate,
                                 partition_layers, placement_of, split_steps, stage_ids, stage_of)
from parallel3d.pipeline.runtime import PipelineStats, run_pipeline_step
from parallel3d.pipeline.runtime_schedules import Post, rank_plan
from test_pipeline_runtime import CFG, microbatches
from test_pipeline_vshape_trainer import MOE, assert_parity, run

READER = {K.RECV_ACT: (K.FORWARD,), K.RECV_GRAD: (K.BACKWARD, K.BACKWARD_INPUT)}


def _flat(plan) -> list:
    return [a for s in plan for a in (s.ops if isinstance(s, Post) else [s])]


def _cases():
    for name in SCHEDULE_NAMES:
        for p in (2, 3, 4):
            for m in (1, p, 2 * p + 1, 8):
                try:
                    yield name, p, m, build_schedule(name, p, m, chunks_per_rank(name, 2))
                except ValueError:
                    continue  # e.g. interleaved needs m % p == 0, dualpipe-v m >= 2p


def test_early_plan_posts_each_receive_before_the_compute_before_its_group():
    checked = 0
    for name, p, m, lists in _cases():
        for rank, acts in enumerate(lists):
            plan = rank_plan(acts, early=True)
            flat = _flat(plan)
            assert sorted(flat, key=str) == sorted(acts, key=str), (name, p, m, rank)
            for keep in (lambda a: not a.kind.is_recv, lambda a: a.kind.is_recv):  # both orders unchanged
                assert [a for a in flat if keep(a)] == [a for a in acts if keep(a)], (name, p, m, rank)
            for i, a in enumerate(acts):
                if not a.kind.is_recv:
                    continue
                before = [c for c in acts[:i] if c.kind.is_compute]
                reader = next(c for c in acts[i:] if c.kind in READER[a.kind]
                              and (c.microbatch, c.chunk) == (a.microbatch, a.chunk))
                assert flat.index(a) < flat.index(reader)
                if before:  # posted before the compute that precedes it in the schedule
                    assert flat.index(a) < flat.index(before[-1]), (name, p, m, rank, a)
                    checked += 1
            # without early receives the plan is the schedule's own grouping
            steps = split_steps(acts)
            assert [s.ops if isinstance(s, Post) else s for s in rank_plan(acts, early=False)] == \
                [tuple(s) if isinstance(s, list) else s for s in steps]
    assert checked > 500


def dualpipe_pairs(acts) -> list[tuple]:
    """DualPipe-V's pairs in one rank's list: a forward directly followed by another microbatch's full
    backward on the other chunk, with the F's outgoing sends and the B's incoming receives."""
    comp = [a for a in acts if a.kind.is_compute]
    out = []
    for f, b in zip(comp, comp[1:]):
        if f.kind is K.FORWARD and b.kind is K.BACKWARD and f.chunk != b.chunk:
            sends = [a for a in acts if a.kind is K.SEND_ACT and (a.microbatch, a.chunk) == (f.microbatch, f.chunk)]
            recvs = [a for a in acts if a.kind is K.RECV_GRAD and (a.microbatch, a.chunk) == (b.microbatch, b.chunk)]
            out.append((f, b, sends, recvs))
    return out


def test_dualpipe_v_plan_overlaps_each_pair():
    """The runtime's plan (gloo: early receives and, for DualPipe-V, early sends) posts the F's output
    between the F and the B, and the B's received gradient before the F. The schedule's own groups did
    not: 210 of these 720 pairs had a message posted after the partner's compute."""
    checked = 0
    for p in (2, 3, 4, 5):
        for m in (2 * p, 2 * p + 1, 3 * p, 16):
            lists = build_schedule("dualpipe-v", p, m, 2)
            for rank, acts in enumerate(lists):
                flat = _flat(rank_plan(acts, early=True, early_sends=True))
                assert sorted(flat, key=str) == sorted(acts, key=str)
                for keep in (lambda a: a.kind.is_compute, lambda a: a.kind.is_recv):
                    assert [a for a in flat if keep(a)] == [a for a in acts if keep(a)]
                for peer in range(p):  # FIFO pairing: sends to each peer keep their order
                    def to(a, peer=peer):
                        return a.kind.is_send and a.peer == peer
                    assert [a for a in flat if to(a)] == [a for a in acts if to(a)]
                for f, b, sends, recvs in dualpipe_pairs(acts):
                    i, j = flat.index(f), flat.index(b)
                    assert all(i < flat.index(a) < j for a in sends), (p, m, rank, f, b, sends)
                    assert all(flat.index(a) < i for a in recvs), (p, m, rank, f, b, recvs)
                    checked += len(sends) + len(recvs)
    assert checked > 500


def _pair_trace_checks(p, m, results):
    """What the gloo runtime did (PipelineStats.trace): each DualPipe-V pair's sends posted between its
    two computes, its receives posted before the F and waited after it (inside the B that reads them)."""
    lists = build_schedule("dualpipe-v", p, m, 2)
    checked = 0
    for rank, acts in enumerate(lists):
        trace = results[rank]["dualpipe-v"][True][0]
        where = {(what, a): i for i, (what, a) in enumerate(trace)}
        for f, b, sends, recvs in dualpipe_pairs(acts):
            run_f, run_b = where[("run", f)], where[("run", b)]
            for a in sends:
                assert run_f < where[("post", a)] < run_b, (p, rank, f, b, a)
            for a in recvs:
                assert where[("post", a)] < run_f < where[("wait", a)], (p, rank, f, b, a)
            checked += len(sends) + len(recvs)
    assert checked >= m - 2 * p + 1, checked  # the main phase's pairs carry messages


# ---------------------------------------------------------------- gloo
class _Watched(nn.Module):
    """A chunk that remembers a weak reference to the storage of each output it returns."""

    def __init__(self, inner: Llama) -> None:
        super().__init__()
        self.inner, self.pre, self.post = inner, inner.pre, inner.post
        self.outputs: list[StorageWeakRef] = []

    def boundary_shape(self, b: int, s: int):
        return self.inner.boundary_shape(b, s)

    def forward(self, x, position_ids, labels=None, **kw):
        out = self.inner(x, position_ids, labels, **kw)
        if not self.post:
            self.outputs.append(StorageWeakRef(out.untyped_storage()))
        return out


def _chunks(ctx, name: str) -> list[_Watched]:
    cfg = ModelConfig(**CFG, num_layers=8)
    p, v, placement = ctx.spec.pp, chunks_per_rank(name, 2), placement_of(name)
    stages = partition_layers(cfg.num_layers, p, v)
    out = []
    for s in stage_ids(ctx.coords.pp, p, v, placement):
        out.append(_Watched(Llama(cfg, ctx, layers=stages[s], pre=s == 0, post=s == p * v - 1)))
        out[-1].inner.init_weights(3)
    return out


def _overlap_worker(w, names, m):
    ctx = w.context(MeshSpec(pp=w.world_size))
    p, rank = ctx.spec.pp, ctx.coords.pp
    out = {}
    for name in names:
        placement, runs = placement_of(name), {}
        for lazy in (True, False):
            chunks, stats = _chunks(ctx, name), PipelineStats(trace=[])
            freed: list[bool] = []

            def before_backward(mb, c, chunks=chunks, freed=freed, lazy=lazy):
                s = stage_of(rank, c, p, placement)
                if not lazy and not chunks[c].post and locate(s + 1, p, placement)[0] != rank:
                    freed.append(chunks[c].outputs[mb].expired())  # sent (and waited): storage gone

            run_pipeline_step(ctx, chunks, name, microbatches(m, b=2), loss_scale=1.0,
                              backward=lambda loss: loss.backward(), before_backward=before_backward,
                              stats=stats, lazy_sends=lazy)
            remote = [c for c in range(len(chunks)) if not chunks[c].post
                      and locate(stage_of(rank, c, p, placement) + 1, p, placement)[0] != rank]
            after = [ref.expired() for c in remote for ref in chunks[c].outputs]
            grads = [q.grad.clone() for c in chunks for q in c.parameters()]
            runs[lazy] = (stats.trace, freed, after, grads)
        out[name] = runs
    return out


def _order_checks(name, p, m, results):
    lists = build_schedule(name, p, m, chunks_per_rank(name, 2))
    checked = sum(len(results[rank][name][False][1]) for rank in range(p))
    assert checked >= m * (p - 1), (name, checked)  # every stage but the last sends each microbatch on
    for rank, acts in enumerate(lists):
        for lazy, expect_early in ((True, True), (False, False)):
            trace, freed, after, grads = results[rank][name][lazy]
            where = {(what, a): i for i, (what, a) in enumerate(trace)}
            early = 0
            for i, a in enumerate(acts):
                before = [c for c in acts[:i] if c.kind.is_compute]
                if a.kind.is_recv and before:
                    early += where[("post", a)] < where[("run", before[-1])]
                if a.kind.is_recv and lazy:  # waited inside the compute that reads it
                    wait = where[("wait", a)]
                    reader = [x for what, x in trace[:wait] if what == "run"][-1]
                    assert reader.kind in READER[a.kind] and (reader.microbatch, reader.chunk) == \
                        (a.microbatch, a.chunk), (name, rank, a, reader)
            recvs = sum(1 for i, a in enumerate(acts) if a.kind.is_recv and any(c.kind.is_compute for c in acts[:i]))
            assert early == (recvs if expect_early else 0), (name, rank, lazy, early, recvs)
            assert all(after), (name, rank, lazy)  # every sent output freed by the end of the step
            if not lazy:
                assert all(freed), (name, rank, freed)
        # early receives change when bytes move, not what is computed: bit-identical gradients
        lazy_grads, strict_grads = results[rank][name][True][3], results[rank][name][False][3]
        assert all(torch.equal(a, b) for a, b in zip(lazy_grads, strict_grads)), (name, rank)


@pytest.mark.parametrize("p", [2, 4])
def test_receives_posted_early_and_sent_outputs_freed(worlds, p):
    names = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"]
    m = 8
    results = worlds.run(p, _overlap_worker, names, m)
    for name in names:
        _order_checks(name, p, m, results)
    _pair_trace_checks(p, m, results)


# ---------------------------------------------------------------- the real Trainer
CKPT_CASES = [  # (schedule, the model and checkpointing: the world-size-1 run gets the latter only)
    (["parallel.schedule=1f1b"], ["train.activation_checkpointing=full", "model.tie_embeddings=true"]),
    (["parallel.schedule=gpipe"], ["train.activation_checkpointing=selective", *MOE]),
    (["parallel.schedule=interleaved", "parallel.virtual_stages=2"],
     ["model.tie_embeddings=true", "train.activation_checkpointing=full"]),
    (["parallel.schedule=zb-h1"], ["train.activation_checkpointing=full", *MOE]),
    (["parallel.schedule=zb-v"], ["train.activation_checkpointing=full", "model.tie_embeddings=true"]),
    (["parallel.schedule=dualpipe-v"], ["train.activation_checkpointing=selective", *MOE]),
]


@pytest.mark.parametrize("schedule,model", CKPT_CASES, ids=lambda x: x[0].split("=")[1])
def test_trainer_with_freed_outputs_matches_world_size_1(worlds, schedule, model):
    model = [*model, "model.num_layers=4"]
    ref = run(None, model)
    got = worlds.run(2, run, ["parallel.pp=2", *schedule, *model])
    assert_parity(got, ref)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-v"])
def test_dry_run_frees_sent_outputs(schedule):
    """The planner's stand-in (meta tensors, simulated groups; planner/dryrun.py) frees a stage output once it
    is sent, as the real run does, so the dry run's activation memory counts what a GPU would hold."""
    from ckpt_helpers import build_trainer, make_config
    from parallel3d.mesh import ParallelContext

    cfg = make_config(["parallel.pp=2", f"parallel.schedule={schedule}", "model.num_layers=4",
                       "train.global_batch_size=4"], 2)
    ctx = ParallelContext.simulated(MeshSpec(pp=2), 0, "meta")
    trainer = build_trainer(cfg, ctx)
    sent = trainer.chunks[0]  # stage 0: its outputs go to pipeline rank 1
    refs: list[StorageWeakRef] = []
    sent.register_forward_hook(lambda m, args, out: refs.append(StorageWeakRef(out.untyped_storage())))
    checked, inner = [], trainer.optimizer.set_last_microbatch

    def before_backward(last: bool, chunk: int) -> None:
        # by any backward, every stage-0 output but perhaps the newest has been sent: all freed
        checked.append([r.expired() for r in refs[:-1]])
        inner(last, chunk)

    trainer.optimizer.set_last_microbatch = before_backward
    trainer.train_step()
    assert len(refs) == 4 and len(checked[-1]) == 3, (len(refs), checked)
    assert all(all(c) for c in checked), checked


def test_breakdown_books_each_span_once():
    """timeline.breakdown (the benchmark's per-rank split): hand-made records, known answer."""
    from parallel3d.pipeline import Action
    from parallel3d.pipeline.timeline import breakdown

    f0, b0 = Action(K.FORWARD, 0), Action(K.BACKWARD, 0)
    sa, rg = Action(K.SEND_ACT, 0, 0, 1), Action(K.RECV_GRAD, 0, 0, 1)
    records = [(0, f0, 0.0, 2.0), (0, sa, 2.0, 2.5), (0, rg, 3.0, 5.0), (0, b0, 5.0, 8.0),
               (1, sa, 1.0, 3.0), (1, rg, 1.0, 3.0), (1, f0, 3.0, 4.0)]  # rank 1: one group, receiving
    r0, r1 = breakdown(records, 2)
    assert r0 == dict(compute=5.0, recv=2.0, send=0.5, between=0.5, outside=0.0)
    assert r1 == dict(compute=1.0, recv=2.0, send=0.0, between=0.0, outside=1.0 + 4.0)
    assert all(sum(r.values()) == 8.0 for r in (r0, r1))
