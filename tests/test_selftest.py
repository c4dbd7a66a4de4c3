"""launch/selftest.py, where a user runs it (torchrun, 4 gloo ranks), and its pieces (parallel3d/selfcheck/).

The command must pass at world 4 with every layout ok or skipped for the world-8 reason, and fail naming
the layout whose run differs from world size 1 (a hidden --inject-mismatch doubles one layout's gradients:
only the grad norm can see that). Its comparison must also fail on a loss, a weight and a missing weight
(mutant runs at world size 1, in process), and its bandwidth figures follow NCCL-tests' formulas and the
planner's link table.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel3d.pipeline.schedules import SCHEDULE_NAMES
from parallel3d.selfcheck import bandwidth, layouts, parity

ROOT = Path(__file__).resolve().parent.parent


def _selftest(args: list[str], ranks: int = 4, timeout: int = 240) -> subprocess.CompletedProcess:
    """launch/selftest.py under torchrun with `ranks` gloo ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           "launch/selftest.py", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_selftest_passes_at_world_4_with_one_table(tmp_path):
    """Every layout that fits 4 ranks trains against world size 1 and is ok; the world-8 combinations say why
    they are skipped; the bandwidth rows are there, and the JSON holds the same table."""
    out = _selftest(["--quick", "--json", str(tmp_path / "t.json")])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    table = json.loads((tmp_path / "t.json").read_text())
    rows = {row["name"]: row for row in table["layouts"]}
    assert list(rows) == list(layouts.NAMES)
    for name, row in rows.items():
        want = "skipped: needs world >= 8" if layouts.LAYOUTS[layouts.NAMES.index(name)].min_world > 4 else "ok"
        assert row["result"] == want, (name, row)
        assert f"\n{name} " in out.stdout, f"{name} has no row in the printed table"
    ran = [row for row in rows.values() if row["result"] == "ok"]
    assert len(ran) >= 20 and all(row["errors"]["weights"] <= parity.WEIGHT_RTOL for row in ran)
    measured = {(row["group"], row["op"]) for row in table["bandwidth"]}
    assert measured >= {("dp", op) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    assert {("tp", "all_reduce"), ("pp", "p2p"), ("ep", "all_to_all")} <= measured
    assert all(row["busbw"] > 0 and row["bytes"] > 0 for row in table["bandwidth"])
    assert out.stdout.rstrip().splitlines()[-1].endswith("0 failed, 2 skipped"), out.stdout[-500:]


@pytest.mark.sweep
def test_selftest_passes_at_world_8(tmp_path):
    """Every layout at 8 ranks, the two world-8 combinations included (3-4 minutes on 2 cores: make sweep)."""
    out = _selftest(["--quick", "--bandwidth-mib", "1", "--json", str(tmp_path / "t.json")], ranks=8, timeout=900)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert [row["result"] for row in json.loads((tmp_path / "t.json").read_text())["layouts"]] == ["ok"] * len(
        layouts.LAYOUTS)


def test_selftest_exits_non_zero_naming_the_layout_that_differs():
    """At world 2 (the start-up is most of its time): tp2's gradients doubled, zero1 untouched."""
    out = _selftest(["--quick", "--only", "zero1,tp2", "--inject-mismatch", "tp2", "--bandwidth-mib", "0"], ranks=2)
    assert out.returncode != 0, out.stdout[-3000:]
    last = out.stdout.rstrip().splitlines()[-1]
    assert last == "1 ok, 1 failed, 0 skipped: FAILED tp2", out.stdout[-3000:]
    assert "step 0 rank 0: grad_norm" in out.stdout and "vs world size 1" in out.stdout


def test_bad_arguments_exit_2_naming_them(capsys, monkeypatch):
    """The command's own main, in process (what it does before any process group; one rank: no torchrun)."""
    from launch.selftest import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)

    for argv, words in ((["--only", "tp2,tp9"], "no layout named tp9"), (["--steps", "0"], "--steps must be"),
                        (["--inject-mismatch", "tp3"], "no layout named tp3"), ([], "start it under torchrun")):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and words in capsys.readouterr().err, argv
    assert main(["--only", "pp2-*", "--list"]) == 0
    assert capsys.readouterr().out.split() == [f"pp2-{s}" for s in SCHEDULE_NAMES]


def test_layouts_cover_every_dimension_and_validate_at_worlds_4_and_8():
    """Each layout is a config that validation accepts wherever it does not say it is skipped."""
    from launch.selftest import make_config

    words = " ".join(o for layout in layouts.LAYOUTS for o in layout.overrides)
    options = [f"parallel.schedule={s}" for s in SCHEDULE_NAMES] + [f"parallel.zero={z}" for z in (1, 2, 3)]
    options += [f"parallel.cp_mode={m}" for m in ("ring", "allgather", "ulysses")]
    options += ["parallel.sp=true", "parallel.dp_shard", "parallel.overlap_param_gather=true",
                "parallel.offload_optimizer=cpu", "parallel.ep_overlap=true"]
    for option in options:
        assert option in words, option
    assert {"moe", "documents"} <= {layout.model for layout in layouts.LAYOUTS}
    for world in (4, 8):
        for layout in layouts.LAYOUTS:
            if layout.skip_reason(world) is None:
                cfg = make_config(layouts.overrides_at(layout, world), world)
                assert cfg.parallel.tp * cfg.parallel.cp * cfg.parallel.dp * cfg.parallel.pp == world, layout.name
                if layout.model == "moe" and "ep" in layout.name:
                    assert cfg.parallel.ep == cfg.parallel.dp, layout.name   # ep == dp: a size-1 expert-DP group
    assert [layout.skip_reason(4) for layout in layouts.LAYOUTS if layout.min_world > 4] == [
        "skipped: needs world >= 8"] * 2


def _ws1(overrides: list[str] = (), double: bool = False) -> dict:
    from launch.selftest import build_trainer, double_gradients, make_config
    from parallel3d.mesh import ParallelContext

    torch.set_num_threads(1)
    layout = layouts.LAYOUTS[0]
    cfg = make_config([*layouts.reference_overrides(layout, 4), *overrides], 1)
    trainer = build_trainer(cfg, ParallelContext.single())
    if double:
        double_gradients(trainer)
    return parity.train(trainer, 2)


@pytest.fixture(scope="module")
def reference():
    return _ws1()


def _check(run: dict, reference: dict) -> list[str]:
    return parity.verdict([parity.local_summary(run, reference)], reference)[0]


def test_the_comparison_fails_on_a_gradient_a_loss_or_a_weight(reference):
    assert _check(_ws1(), reference) == []
    doubled = _check(_ws1(double=True), reference)
    assert doubled and all("grad_norm" in m for m in doubled), doubled   # clipping hides it from the rest
    slower = _check(_ws1(["train.lr=2.9e-3"]), reference)
    assert any("step 1 rank 0: loss" in m for m in slower) and any("weights after 2 steps" in m for m in slower)
    assert not any("step 0" in m for m in slower), slower   # the first step's loss is before any update


def test_the_comparison_splits_weights_across_ranks_and_counts_them(reference):
    """Two 'ranks' holding the halves of every weight (rows) pass together; one half alone is reported as
    missing elements, and a nudged element past the tolerance names its weight."""
    halves = [{"losses": reference["losses"], "norms": reference["norms"], "weights": {}} for _ in range(2)]
    for name, ((t, shape, _),) in reference["weights"].items():
        full = t.reshape(shape)
        cut = (shape[0] + 1) // 2
        for i, rows in enumerate((slice(0, cut), slice(cut, shape[0]))):
            sl = (rows,) + tuple(slice(0, n) for n in shape[1:])
            halves[i]["weights"][name] = [(full[sl].clone(), shape, sl)]
    summaries = [parity.local_summary(h, reference) for h in halves]
    assert parity.verdict(summaries, reference)[0] == []
    assert "master-weight elements" in parity.verdict(summaries[:1], reference)[0][0]
    name = "lm_head.weight"
    (piece, shape, sl), = halves[1]["weights"][name]
    piece[0, 0] += 3 * (parity.WEIGHT_ATOL + parity.WEIGHT_RTOL * piece[0, 0].abs())
    bad = parity.verdict([parity.local_summary(h, reference) for h in halves], reference)[0]
    assert len(bad) == 1 and bad[0].startswith(f"rank 1: weights after 2 steps, {name} max rel err 3"), bad


def test_bus_bandwidth_follows_nccl_tests_and_the_planner_links():
    """NCCL-tests' bus factors; the planner's figure for a large message is its link's bandwidth (NVLink4 450
    GB/s x 0.8 on an H100 node, NDR 50 GB/s x 0.9 across nodes), the latency negligible at 16 GiB."""
    from parallel3d.planner.hardware import gpu

    assert bandwidth.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    assert bandwidth.bus_factor("all_gather", 4) == bandwidth.bus_factor("all_to_all", 4) == pytest.approx(0.75)
    assert bandwidth.bus_factor("p2p", 2) == 1.0
    h100 = gpu("h100")
    for op in ("all_reduce", "reduce_scatter", "all_to_all", "p2p"):
        row = {"op": op, "bytes": 2**34, "ranks": list(range(8)), "size": 8}
        assert bandwidth.planner_busbw(row, h100, 8) == pytest.approx(360e9, rel=3e-3), op
        assert bandwidth.planner_busbw({**row, "ranks": [0, 8, 16, 24], "size": 4}, h100, 8) == pytest.approx(
            45e9, rel=3e-3)
    assert bandwidth.link_words([0, 8], 8) == "network" and bandwidth.link_words([0, 1], 8) == "intra-node"
