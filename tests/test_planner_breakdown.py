"""Which rank each figure of a plan's breakdown is (planner/estimate.py): times are the actions as the
schedule simulator priced them (each stage's at its slowest dry-run rank), of the busiest stage where one
stage is meant, averaged over the stages for one action, as a run's timeline averages its ranks' actions
(`plan.py --compare` sets the two side by side). Before, the per-action and per-microbatch figures were
the rank with the fullest memory alone: at pp2, one stage's forward against the run's mean of both."""
from __future__ import annotations

import statistics

import pytest

from ckpt_helpers import make_config
from parallel3d.planner.estimate import plan
from parallel3d.planner.hardware import gpu
from test_planner import SMALL, _stage_builder


def test_the_breakdowns_times_are_the_priced_actions_of_every_stage():
    cfg = make_config(["parallel.pp=2", "parallel.tp=1", "parallel.schedule=1f1b", *SMALL], 2)
    cache: dict = {}
    result = plan(cfg, _stage_builder, gpu("h100"), 8, cache=cache)
    stages = {run.pp_rank for run in cache.values()}
    priced = {stage: {key: max((run.actions[key] for run in cache.values() if run.pp_rank == stage),
                               key=lambda c: c.time_s)
                      for key in next(run for run in cache.values() if run.pp_rank == stage).actions}
              for stage in stages}
    assert stages == {0, 1}
    forwards = [priced[stage][("FORWARD", 0)].time_s for stage in (0, 1)]
    assert forwards[1] > 1.05 * forwards[0]   # the last stage also runs the head and the loss
    b = result.breakdown
    assert b["action_s"]["FORWARD.0"] == pytest.approx(statistics.mean(forwards))
    busiest = max(stages, key=lambda stage: sum(c.time_s for c in priced[stage].values()))
    assert b["compute_per_microbatch_s"] == pytest.approx(sum(c.compute_s for c in priced[busiest].values()))
    m = cfg.train.num_microbatches   # 1F1B: every stage runs each of its actions once per microbatch
    assert b["shares"]["compute"] * result.step_time_s == pytest.approx(m * b["compute_per_microbatch_s"])
