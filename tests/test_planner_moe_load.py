"""The MoE routing load: what a dropless run's router did to its busiest EP rank, read from the run's JSONL
(`--compare`), and a plan of that rank at the load (`launch/plan.py --moe-load`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))

TINY_EP = ["parallel.tp=1", "model.num_layers=2", "parallel.ep=2", "model.num_experts=4", "model.moe_top_k=2",
           "parallel.dp=0", "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=32"]


def _cfg(extra=()):
    from parallel3d.models.config import ModelConfig
    from parallel3d.training.config import load_config
    from parallel3d.training.validate import resolve_and_validate

    return resolve_and_validate(load_config(str(ROOT / "configs/tiny.yaml"), TINY_EP + list(extra), ModelConfig), 2)


def test_rank_load_is_the_busiest_ranks_share_over_the_balanced_share():
    from parallel3d.expert_parallel.dispatch import rank_load

    assert rank_load([181, 945, 637, 285], 2) == pytest.approx(1126 / 1024)   # experts 0-1 on rank 0
    assert rank_load([0, 512, 512, 0], 2) == 1.0          # uneven experts, even ranks
    assert rank_load([512, 512, 0, 0], 2) == 2.0          # every slot on rank 0
    assert rank_load([0, 0, 0, 0], 2) == 1.0


def test_the_dry_run_routes_the_planned_rank_its_load():
    """At --moe-load 2 the planned rank's experts receive every routed slot of both ranks: the dispatch and
    combine all-to-alls carry what it receives back (each direction sends what the other received), and the
    rows its experts hold as activations grow; the dense all-reduce does not change."""
    from common import stage_builder
    from parallel3d.planner.estimate import plan
    from parallel3d.planner.hardware import gpu

    cfg = _cfg()
    plans = {f: plan(cfg, stage_builder, gpu("h100"), 8, expert_load=f) for f in (1.0, 1.5, 2.0)}
    balanced, busiest = plans[1.0], plans[2.0]
    assert busiest.expert_load == 2.0 and busiest.to_json()["expert_load"] == 2.0
    assert busiest.comm_bytes["dp_cp.all_reduce"] == balanced.comm_bytes["dp_cp.all_reduce"]
    # dispatch sends this rank's own rows (balanced), combine sends back what it received (load x balanced):
    # the bytes grow linearly with the load, by half of the balanced round trip from 1 to 2 (plus E counts)
    sent = {f: p.comm_bytes["ep.all_to_all"] for f, p in plans.items()}
    assert sent[2.0] - sent[1.5] == sent[1.5] - sent[1.0] > 0
    assert 0.49 * sent[1.0] < sent[2.0] - sent[1.0] <= 0.5 * sent[1.0]
    assert busiest.memory["activations"] > balanced.memory["activations"]


@pytest.mark.parametrize("load, extra, message", [
    (2.5, [], "must be in [1, 2]"),
    (0.9, [], "must be in [1, 2]"),
    (1.5, ["model.capacity_factor=1.25"], "capacity_factor=1.25"),
])
def test_a_load_out_of_range_is_refused_before_any_dry_run(load, extra, message, capsys):
    from launch import plan as plan_cli

    with pytest.raises(SystemExit) as refused:
        plan_cli.main(["--config", str(ROOT / "configs/tiny.yaml"), "--world-size", "2", "--moe-load", str(load),
                       *TINY_EP, *extra])
    assert refused.value.code != 0 and message in capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["parallel.tp=1", "model.num_layers=2"], "parallel.ep > 1"),   # a dense layout has no routing load
    (["--search", *TINY_EP], "--search"),                           # a search compares balanced layouts
])
def test_a_load_without_one_moe_layout_is_refused(extra, message, capsys):
    from launch import plan as plan_cli

    with pytest.raises(SystemExit) as refused:
        plan_cli.main(["--config", str(ROOT / "configs/tiny.yaml"), "--world-size", "2", "--gpu", "cpu",
                       "--moe-load", "1.3", *extra])
    assert refused.value.code != 0 and message in capsys.readouterr().err


def test_compare_reads_the_runs_routing_load_and_says_how_to_plan_it(tmp_path, capsys):
    """A run's JSONL (as loop.py logs moe_tokens_per_expert per layer) is read at its steady steps: the mean over
    layers of each layer's busiest-rank share, the median over the later half of the steps; `--compare`
    prints it beside the plan's load and names the flag that plans it."""
    from launch import plan as plan_cli
    from parallel3d.planner.compare import read_run

    def row(step, layers):
        return json.dumps({"step": step, "step_time_s": 1.0, "peak_mem_bytes": 1,
                           **{f"moe_tokens_per_expert.{i}": t for i, t in enumerate(layers)}}) + "\n"

    jsonl = tmp_path / "run.jsonl"
    warm = [[256, 256, 256, 256], [256, 256, 256, 256]]      # 1.0
    steady = [[512, 256, 128, 128], [128, 128, 512, 256]]    # 1.5 in both layers
    jsonl.write_text(row(1, warm) + row(2, warm) + row(3, steady) + row(4, steady))
    assert read_run(str(jsonl), ep=2)["moe_load"] == pytest.approx(1.5)
    assert read_run(str(jsonl), ep=4)["moe_load"] == pytest.approx(2.0)
    assert "moe_load" not in read_run(str(jsonl), ep=1)
    plan_cli.main(["--config", str(ROOT / "configs/tiny.yaml"), "--world-size", "2", "--compare", str(jsonl),
                   *TINY_EP])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("MoE routing load"))
    assert line.split()[-3:] == ["1.00", "1.50", "1.50"], line
    assert "--moe-load 1.50" in out
