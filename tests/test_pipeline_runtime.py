"""Pipeline runtime behaviour: activation memory per schedule, measured timelines, split backward,
single-rank execution and error messages. Parity with world size 1 lives in test_pp_parity.py."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Llama
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.pipeline import (ActionKind, Timeline, build_schedule, partition_layers,
                                 peak_in_flight, simulate)
from parallel3d.pipeline.backward import backward_input, backward_weight
from parallel3d.pipeline.runtime import (PipelineStats, ScheduleCache, forward_only_schedule,
                                         run_pipeline_forward, run_pipeline_step)

CFG = dict(vocab_size=64, hidden_size=32, num_heads=4, num_kv_heads=2, ffn_hidden_size=48)
S = 16


def microbatches(m: int, b: int = 1, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG["vocab_size"], (m, b, S + 1), generator=g)
    return [{"ids": t[:, :-1], "labels": t[:, 1:], "position_ids": torch.arange(S)} for t in tokens]


def build_chunks(ctx: ParallelContext, num_layers: int, v: int, **kwargs) -> list[Llama]:
    cfg = ModelConfig(**CFG, num_layers=num_layers)
    pp, stages = ctx.spec.pp, partition_layers(num_layers, ctx.spec.pp, v)
    chunks = []
    for c in range(v):
        s = c * pp + ctx.coords.pp
        chunks.append(Llama(cfg, ctx, layers=stages[s], pre=s == 0, post=s == pp * v - 1, **kwargs))
        chunks[-1].init_weights(3)
    return chunks


# ---------------------------------------------------------------- memory and timelines (gloo)
RUNS = [("gpipe", 8, True), ("1f1b", 8, True), ("1f1b", 2, True), ("gpipe", 2, True),
        ("zb-h1", 8, True), ("interleaved", 8, True), ("1f1b", 8, False)]  # last: strict sends


def _memory_worker(w):
    ctx = w.context(MeshSpec(pp=w.world_size))
    out = []
    for name, m, lazy in RUNS:
        chunks = build_chunks(ctx, 8, 2 if name == "interleaved" else 1)
        stats, record = PipelineStats(), []
        loss = run_pipeline_step(ctx, chunks, name, microbatches(m), loss_scale=1.0,
                                 backward=lambda loss: loss.backward(), stats=stats,
                                 record=record, lazy_sends=lazy)
        out.append((stats.peak_live, record, loss.item()))
    return out


def test_live_activations_and_measured_timeline(worlds):
    p = 4
    results = worlds.run(p, _memory_worker)
    losses = {}
    for i, (name, m, lazy) in enumerate(RUNS):
        v = 2 if name == "interleaved" else 1
        schedule = build_schedule(name, p, m, v)
        peaks = [r[i][0] for r in results]
        # what the runtime held is what the schedule promises (kept until the weight pass)
        assert peaks == [peak_in_flight(s, until_weight=True) for s in schedule], (name, m, peaks)
        if name == "1f1b":
            assert peaks[0] == min(p, m)
        if name == "gpipe":
            assert peaks[0] == m
        records = [rec for r in results for rec in r[i][1]]
        for rank in range(p):  # every action ran once; computes and sends in schedule order, receives
            mine = [a for r, a, *_ in records if r == rank]  # where the compute reading them waited
            assert sorted(mine, key=str) == sorted(schedule[rank], key=str)
            assert [a for a in mine if not a.kind.is_recv] == [a for a in schedule[rank] if not a.kind.is_recv]
            if not lazy:  # strict sends: every group posted and waited whole, as scheduled
                assert mine == schedule[rank]
            start = {(a.kind, a.microbatch, a.chunk): s0 for r, a, s0, _ in records if r == rank}
            for r, a, _, end in records:  # a receive is complete before the compute that reads it
                if r == rank and a.kind.is_recv:
                    reader = [k for k in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)
                              if (k, a.microbatch, a.chunk) in start and (k is ActionKind.FORWARD) == (a.kind is ActionKind.RECV_ACT)]
                    assert reader and end <= start[(reader[0], a.microbatch, a.chunk)], (name, rank, a)
        for rank in range(p):  # one rank computes one action at a time: compute intervals never overlap
            spans = sorted((s0, s1) for r, a, s0, s1 in records if r == rank and a.kind.is_compute)
            assert all(s1 >= s0 for s0, s1 in spans) and all(b0 >= a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))
        # the measured timeline's bubble is the idle share of p x makespan, recomputed from the raw records
        timeline = Timeline.from_events(records, num_ranks=p)
        span = max(r[3] for r in records) - min(r[2] for r in records)
        busy = sum(r[3] - r[2] for r in records if r[1].kind.is_compute)
        assert timeline.makespan == pytest.approx(span)
        assert timeline.bubble_fraction == pytest.approx(1 - busy / (p * span)), (name, m)
        compute = [e for e in timeline.events[0] if e.action.kind.is_compute]
        assert all(a.end <= b.start for a, b in zip(compute, compute[1:]))  # one thing at a time
        losses.setdefault(m, set()).add(results[-1][i][2])  # the last rank holds the loss
    assert all(len(v) == 1 for v in losses.values()), losses  # every schedule, the same loss


# ---------------------------------------------------------------- errors before any message
def _error_worker(w):
    ctx = w.context(MeshSpec(pp=w.world_size))
    chunks = build_chunks(ctx, 4, 1)
    two = build_chunks(ctx, 4, 2)
    middle = Llama(ModelConfig(**CFG, num_layers=4), ctx, layers=[1], pre=False, post=False)
    calls = [
        lambda: run_pipeline_step(ctx, two, "interleaved", microbatches(3), loss_scale=1.0,
                                  backward=torch.Tensor.backward),
        lambda: run_pipeline_step(ctx, chunks, "pipedream", microbatches(2), loss_scale=1.0,
                                  backward=torch.Tensor.backward),
        lambda: run_pipeline_step(ctx, two, "1f1b", microbatches(2), loss_scale=1.0,
                                  backward=torch.Tensor.backward),
        lambda: run_pipeline_step(ctx, [middle], "1f1b", microbatches(2), loss_scale=1.0,
                                  backward=torch.Tensor.backward),
        lambda: run_pipeline_forward(ctx, chunks, []),
    ]
    messages = []
    for call in calls:
        try:
            call()
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    return messages


def _message(fn, *args) -> str:
    with pytest.raises(ValueError) as info:
        fn(*args)
    return str(info.value)


def test_bad_configs_fail_with_the_schedule_message(worlds):
    results = worlds.run(2, _error_worker)
    for msgs in results:  # every rank raises the same error, so none waits for a peer
        assert msgs[0] == _message(build_schedule, "interleaved", 2, 3, 2)
        assert "multiple of the pipeline size" in msgs[0]
        assert msgs[1] == _message(build_schedule, "pipedream", 2, 2, 1)
        assert msgs[2] == _message(build_schedule, "1f1b", 2, 2, 2)
        assert msgs[4] == "a pipeline run needs at least one microbatch"
    assert "global stage 0 of 2: expected pre=True" in results[0][3]  # built as a middle stage
    assert "global stage 1 of 2: expected post=True" in results[1][3]


def test_more_stages_than_layers_is_a_clear_error():
    msg = _message(partition_layers, 2, 4, 2)
    assert "cannot split 2 layers into 8 pipeline stages" in msg


def test_forward_only_order_never_deadlocks():
    for p, m, v in [(2, 1, 1), (2, 3, 2), (4, 5, 1), (4, 3, 3), (3, 4, 2)]:
        lists = forward_only_schedule(p, m, v)
        timeline = simulate(lists)  # raises ScheduleError on deadlock or unmatched messages
        assert sum(e.action.kind is ActionKind.FORWARD for evs in timeline.events for e in evs) \
            == m * p * v


# ---------------------------------------------------------------- single process
def test_split_backward_matches_backward_and_fires_hooks():
    class Twice(nn.Module):  # one weight used twice on the input path: two linked intermediates
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(torch.tanh(self.lin(x))) * self.scale + self.scale.sum()

    torch.manual_seed(0)
    model, x, g = Twice(), torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    fired = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    dx, work = backward_input(model(x), g, x, list(model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and not fired
    backward_weight(work)
    split = [p.grad.clone() for p in model.parameters()]
    assert len(fired) == len(split)
    model.zero_grad()
    x2 = x.detach().requires_grad_()
    model(x2).backward(g)
    torch.testing.assert_close(dx, x2.grad)
    for got, p in zip(split, model.parameters()):
        torch.testing.assert_close(got, p.grad)


@pytest.mark.parametrize("name,v", [("interleaved", 2), ("interleaved", 3), ("zb-h1", 1),
                                    ("gpipe", 1)])
def test_single_rank_pipeline_matches_plain_model(name, v):
    """p == 1: chunks hand activations and gradients over locally, no communication."""
    ctx, mbs, dtype_total = ParallelContext.single(), microbatches(3, b=2), 3 * 2 * S
    ref = build_chunks(ctx, 3, 1)[0]
    want = sum(ref(mb["ids"], mb["position_ids"], mb["labels"]) / dtype_total for mb in mbs)
    want.backward()
    chunks = build_chunks(ctx, 3, v)
    seen = []
    got = run_pipeline_step(ctx, chunks, name, mbs, loss_scale=1 / dtype_total,
                            backward=lambda loss: loss.backward(),
                            before_backward=lambda mb, c: seen.append((mb, c)),
                            schedules=ScheduleCache())
    torch.testing.assert_close(got, want.detach())
    assert {mb for mb, _ in seen} == {0, 1, 2} and {c for _, c in seen} == set(range(v))
    grads = {n: p.grad for c in chunks for n, p in c.named_parameters()}
    for n, p in ref.named_parameters():
        torch.testing.assert_close(grads[n], p.grad)
    evaluated = run_pipeline_forward(ctx, chunks, mbs)
    torch.testing.assert_close(evaluated / dtype_total, want.detach())


def test_bf16_chunks_run_in_bf16():
    ctx, mbs = ParallelContext.single(), microbatches(2, b=2)
    chunks = [c.to(torch.bfloat16) for c in build_chunks(ctx, 2, 2)]
    fp32 = run_pipeline_forward(ctx, build_chunks(ctx, 2, 2), mbs)
    got = run_pipeline_step(ctx, chunks, "interleaved", mbs, loss_scale=1.0,
                            backward=lambda loss: loss.backward())
    assert got.dtype == torch.float32 and got.dim() == 0
    assert abs(got.item() - fp32.item()) < 2e-2 * fp32.item()
    assert all(p.grad.dtype == torch.bfloat16 for c in chunks for p in c.parameters())
