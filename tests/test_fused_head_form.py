"""model.fused_head_form (auto, summed, per_token): the fused head's loss form, and auto's rule.

summed forms the head's gradients in the forward and holds them (a (V/tp, h) fp32 d weight accumulator and
d hidden) until the head's backward; per_token holds the per-token lse and recomputes the logits in the
backward. auto resolves (training/validate.resolve_and_validate) to per_token when the schedule's actions
keep more than one microbatch between the head's forward and its backward (pipeline/head_form.py).

Checked: the rule over every schedule's real action lists; a bad value fails once, naming it; the two forms
give the same losses, logged grad norms and weights through the real Trainer (world size 1 with several
chunks, and gpipe at pp=2 against world size 1); the planner's dry run of gpipe shows the held accumulators
byte for byte.
"""
from __future__ import annotations

import pytest
import torch

from ckpt_helpers import make_config
from parallel3d.models.config import FUSED_HEAD_FORMS, ModelConfig
from parallel3d.pipeline.head_form import fused_head_form, head_holder, head_in_flight
from parallel3d.pipeline.schedules import build_schedule
from parallel3d.training.config import ConfigError
from test_trainer_regressions import assert_parity, run

SUMMED, PER_TOKEN = ["model.fused_head_form=summed"], ["model.fused_head_form=per_token"]


def test_auto_is_the_default_and_names_every_form():
    assert ModelConfig().fused_head_form == "auto"
    assert FUSED_HEAD_FORMS == ("auto", "summed", "per_token")


# (schedule, p, m, v) -> (rank, chunk) holding the head, microbatches it keeps in flight, auto's form
RULE = {
    ("gpipe", 2, 4, 1): ((1, 0), 4, "per_token"),      # every forward before any backward
    ("gpipe", 4, 8, 1): ((3, 0), 8, "per_token"),
    ("gpipe", 1, 4, 1): ((0, 0), 4, "per_token"),      # pp=1 runs gpipe's list too: all forwards first
    ("1f1b", 2, 4, 1): ((1, 0), 1, "summed"),          # the last stage: F then B, no warm-up
    ("1f1b", 4, 8, 1): ((3, 0), 1, "summed"),
    ("1f1b", 1, 4, 1): ((0, 0), 1, "summed"),          # pp=1 accumulation: microbatch after microbatch
    ("1f1b", 1, 1, 1): ((0, 0), 1, "summed"),
    ("interleaved", 2, 4, 2): ((1, 1), 1, "summed"),   # the head's chunk is last: no warm-up on it
    ("interleaved", 4, 8, 2): ((3, 1), 1, "summed"),
    ("interleaved", 2, 8, 3): ((1, 2), 1, "summed"),
    ("zb-h1", 2, 4, 1): ((1, 0), 2, "summed"),         # the last rank defers W by p - 1 microbatches: the head's
    ("zb-h1", 4, 8, 1): ((3, 0), 4, "summed"),         # graph lives until W; summed, as its backward runs twice
    ("zb-h1", 1, 4, 1): ((0, 0), 1, "summed"),
    ("zb-v", 2, 4, 2): ((0, 1), 1, "summed"),          # V placement: rank 0's second chunk holds the head
    ("zb-v", 4, 8, 2): ((0, 1), 1, "summed"),
    ("dualpipe-v", 2, 4, 2): ((0, 1), 1, "summed"),
    ("dualpipe-v", 4, 16, 2): ((0, 1), 1, "summed"),
}


@pytest.mark.parametrize("key", list(RULE), ids=lambda k: "-".join(map(str, k)))
def test_head_in_flight_over_the_real_schedules(key):
    holder, in_flight, form = RULE[key]
    schedule = build_schedule(*key)
    assert head_holder(schedule) == holder
    assert head_in_flight(schedule) == in_flight
    assert fused_head_form(schedule) == form


def test_a_split_backward_holds_the_head_until_its_weight_pass():
    """zb-h1 at p=2 on the last rank: I0 then F2 before W0, so microbatches 0..1 (not 0 alone) are held."""
    last = build_schedule("zb-h1", 2, 4)[1]
    order = [a.short() for a in last if a.kind.is_compute]
    assert order[:4] == ["F0", "I0", "F1", "I1"] and order.index("W0") > order.index("F1")


@pytest.mark.parametrize("overrides, world, form", [
    ([], 1, "summed"),                                                        # tiny: 1f1b, pp=1, 4 microbatches
    (["parallel.schedule=gpipe"], 1, "per_token"),
    (["parallel.pp=2", "parallel.tp=1"], 2, "summed"),
    (["parallel.pp=2", "parallel.tp=1", "parallel.schedule=gpipe"], 2, "per_token"),
    (["parallel.pp=2", "parallel.tp=1", "parallel.schedule=zb-h1"], 2, "summed"),     # split backward
    (["parallel.pp=2", "parallel.tp=1", "parallel.schedule=interleaved", "parallel.virtual_stages=2"], 2, "summed"),
    (["parallel.pp=2", "parallel.tp=1", "parallel.schedule=dualpipe-v"], 2, "summed"),
    (["parallel.pp=2", "parallel.tp=1", "parallel.schedule=gpipe", *SUMMED], 2, "summed"),  # an explicit form stays
    ([*PER_TOKEN], 1, "per_token"),
])
def test_auto_resolves_with_the_config(overrides, world, form):
    cfg = make_config(overrides, world)
    assert cfg.model.fused_head_form == form


def test_a_bad_form_is_one_clear_error():
    with pytest.raises(ConfigError) as e:
        make_config(["model.fused_head_form=sum"], 1)
    assert str(e.value) == "model.fused_head_form must be one of auto, summed, per_token, got 'sum'"


def test_the_model_runs_the_form_it_is_given(monkeypatch):
    """The model reads the concrete form: summed -> reduction="sum", per_token -> reduction="none", summed."""
    from parallel3d.kernels import dispatch
    from parallel3d.mesh import ParallelContext
    from parallel3d.models.llama import Llama
    seen = []
    real = dispatch.fused_linear_cross_entropy

    def spy(*args, **kwargs):
        seen.append(kwargs["reduction"])
        return real(*args, **kwargs)
    monkeypatch.setattr(dispatch, "fused_linear_cross_entropy", spy)
    losses = {}
    for form in ("summed", "per_token"):
        cfg = ModelConfig(vocab_size=203, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
                          ffn_hidden_size=64, kernels="torch", fused_head_form=form)
        model = Llama(cfg, ParallelContext.single())
        model.init_weights(7)
        ids = torch.randint(0, 203, (2, 16), generator=torch.Generator().manual_seed(0))
        losses[form] = model(ids, torch.arange(16), ids)
        assert losses[form].shape == ()
    assert seen == ["sum", "none"]
    torch.testing.assert_close(losses["per_token"], losses["summed"], rtol=1e-6, atol=0)


@pytest.mark.parametrize("layout", [[], ["model.tie_embeddings=true", "parallel.schedule=gpipe"]],
                         ids=["1f1b", "tied-gpipe"])
def test_per_token_equals_summed_through_the_trainer(monkeypatch, layout):
    """World size 1, several chunks a microbatch (32 tokens, 8-row chunks): loss, grad_norm and weights after
    3 AdamW steps are the same in both forms."""
    import parallel3d.kernels.fused_linear_cross_entropy as flce
    monkeypatch.setattr(flce, "head_chunk_rows", lambda rows, vocab, hidden: 8)
    ref = run(None, [*layout, *SUMMED], 3)
    assert_parity([run(None, [*layout, *PER_TOKEN], 3)], ref)


def test_gpipe_pp2_auto_equals_summed_at_world_size_1(worlds):
    """gpipe at pp=2 resolves to per_token; its losses, grad norms and weights equal the summed world-1 run."""
    layout = ["parallel.pp=2", "parallel.tp=1", "parallel.schedule=gpipe", "model.num_layers=3"]
    assert make_config(layout, 2).model.fused_head_form == "per_token"
    ref = run(None, ["model.num_layers=3", "parallel.schedule=gpipe", *SUMMED], 3)
    assert_parity(worlds.run(2, run, layout, 3), ref)


def test_zb_h1_pp2_per_token_equals_summed_at_world_size_1(worlds):
    """zb-h1 splits the head's backward into an input and a weight pass (pipeline/backward.py); per_token's
    node runs in both, forming d hidden in the first and d weight in the second (tests/test_split_backward.py
    counts the matmuls). Losses, grad norms and weights after the steps equal the summed world-1 run."""
    layout = ["parallel.pp=2", "parallel.tp=1", "parallel.schedule=zb-h1", "model.num_layers=3", *PER_TOKEN]
    ref = run(None, ["model.num_layers=3", *SUMMED], 3)
    assert_parity(worlds.run(2, run, layout, 3), ref)


def _head_stage_peak(m: int, form: str) -> tuple[str, int]:
    """(resolved form, planned peak bytes of the head's stage) of gpipe at pp=2 with m microbatches; m <= 4 =
    2 p v, so the dry run runs all m (estimate.run_microbatches) and nothing is scaled."""
    from parallel3d.planner.estimate import plan
    from test_planner import H100, SMALL, _stage_builder
    cfg = make_config(["parallel.pp=2", "parallel.tp=1", "parallel.schedule=gpipe", *SMALL, "model.vocab_size=4096",
                       f"train.global_batch_size={m}", f"model.fused_head_form={form}"], 2)
    result = plan(cfg, _stage_builder, H100, 8)
    assert result.roles[1]["in_flight"] == m
    return cfg.model.fused_head_form, result.roles[1]["memory"]["peak"]


def test_dry_run_gpipe_auto_holds_no_accumulator_per_microbatch():
    """The planner's meta dry run (launch/plan.py's path), gpipe pp=2, fp32, v=4096, h=64, 64 tokens a
    microbatch. Each microbatch in flight on the head's stage holds, summed: d weight (4 v h bytes) and d hidden
    (4 n h); per_token: the saved hidden (4 n h, the size of d hidden) and the lse (4 n). So from 1 to 4
    microbatches in flight summed's peak gains exactly 3 (4 v h - 4 n) bytes over auto's (per_token)."""
    v, h, n = 4096, 64, 64
    peaks = {(m, form): _head_stage_peak(m, form) for m in (1, 4) for form in ("auto", "summed", "per_token")}
    assert peaks[1, "auto"] == peaks[1, "summed"] and peaks[1, "auto"][0] == "summed"   # one in flight
    assert peaks[4, "auto"] == peaks[4, "per_token"] and peaks[4, "auto"][0] == "per_token"
    gap = {m: peaks[m, "summed"][1] - peaks[m, "per_token"][1] for m in (1, 4)}
    assert gap[4] - gap[1] == 3 * (4 * v * h - 4 * n) == 3_144_960
    assert peaks[4, "summed"][1] - peaks[4, "auto"][1] == 4_191_096   # measured at commit time (bytes, exact)


@pytest.mark.parametrize("name,pp,v", [("gpipe", 1, 1), ("gpipe", 4, 1), ("1f1b", 1, 1), ("1f1b", 4, 1),
                                       ("interleaved", 2, 2), ("interleaved", 4, 3), ("zb-h1", 4, 1),
                                       ("zb-v", 2, 2), ("dualpipe-v", 4, 2)])
def test_the_form_from_a_prefix_of_the_microbatches_is_the_whole_lists(name, pp, v):
    """head_form_of (what resolve_and_validate calls) builds at most about 2 pp v microbatches; the form it
    gives is the one the whole list gives, for every microbatch count the schedule takes up to 6 pp v."""
    from parallel3d.pipeline.head_form import head_form_of
    from parallel3d.pipeline.placement import check_schedule_config
    for m in range(1, 6 * pp * v + 1):
        try:
            chunks = check_schedule_config(name, pp, v, m)
        except ValueError:
            continue
        assert head_form_of(name, pp, m, v) == fused_head_form(build_schedule(name, pp, m, chunks)), m
