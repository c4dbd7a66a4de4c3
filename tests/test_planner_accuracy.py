"""The planner against real runs (issue 29): this machine's profile and its cache, the accuracy benchmark's
smoke run, `launch/plan.py --compare` on a real CPU run, one table of GPU peaks, the host step rate of
offload, and `--search`'s dry-run budget. No speed figure is asserted: bytes are, and the structure."""
from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from parallel3d.planner import profile, profile_gloo
from parallel3d.planner.hardware import gpu

ROOT = Path(__file__).resolve().parents[1]
CURVE = [[65536.0, 2e-6], [524288.0, 5e-6], [4194304.0, 2.5e-5], [33554432.0, 2e-4]]
LINK = [1e-4, 1e9]


def fake_profile(cores: int = 2, worlds=(1, 2, 4)) -> dict:
    """A profile file as profile.py writes it, with round numbers (no measuring in these tests)."""
    compute = {"matmul": {"fp32": CURVE, "bf16": CURVE}, "memory_bytes_per_s": 2e10, "op_overhead_s": 1e-5,
               "host_step_params_per_s": 3e8,
               "attention": {"flash_attention_fwd": CURVE, "flash_attention_bwd": CURVE},
               "hot_bytes_per_s": 1e11, "memory_bytes_per_s_cold": 1e10, "cache_bytes": 32 * 2 ** 20}
    gloo = {str(w): {"collectives": {op: LINK for op in profile_gloo.COLLECTIVES}, "base_rss_bytes": 300 * 2 ** 20}
            for w in worlds if w > 1}
    return {"version": profile.VERSION, "host": socket.gethostname(), "cores": cores, "compute": compute,
            "gloo": gloo}


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """XDG_CACHE_HOME in a temporary folder holding a fake profile of this machine."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = profile.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(fake_profile(cores=profile.cores())))
    return tmp_path


def test_profile_is_measured_once_then_read_from_its_cache(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(profile, "measure_compute", lambda builder=None: calls.append("compute") or
                        fake_profile()["compute"])
    monkeypatch.setattr(profile, "measure_gloo", lambda world: calls.append(f"gloo{world}") or
                        fake_profile()["gloo"]["2"])
    path = tmp_path / "hw.json"
    first = profile.cpu_device(2, path=path)
    assert calls == ["compute", "gloo2"] and path.exists()
    saved = json.loads(path.read_text())
    assert saved["cores"] == profile.cores() and set(saved["gloo"]) == {"2"}
    assert profile.cpu_device(2, path=path) == first and calls == ["compute", "gloo2"]   # from the file
    profile.cpu_device(4, path=path)            # another world size: only its collectives are measured
    assert calls == ["compute", "gloo2", "gloo4"]
    profile.cpu_device(2, reprofile=True, path=path)
    assert calls[3:] == ["compute", "gloo2"]


def test_ranks_sharing_cores_are_priced_as_they_run(tmp_path):
    """World 2 on 2 cores: one core per rank; world 4 on 2 cores: half a core each, so every compute rate
    halves (matmul, bandwidth, per-op overhead, host step) and collectives use world 4's measurement."""
    path = tmp_path / "hw.json"
    path.write_text(json.dumps(fake_profile(cores=2)))
    two, four = profile.cpu_device(2, path=path), profile.cpu_device(4, path=path)
    assert two.peak_flops["fp32"] == pytest.approx(2 * four.peak_flops["fp32"])
    assert two.hbm_bytes_per_s == pytest.approx(2 * four.hbm_bytes_per_s)
    assert four.op_overhead_s == pytest.approx(2 * two.op_overhead_s)
    assert two.host_step_params_per_s == pytest.approx(3e8) and four.host_step_params_per_s == pytest.approx(1.5e8)
    # ranks share the last-level cache; a byte from memory costs what an add measured beyond the cache
    assert (two.cache_bytes, four.cache_bytes) == (16 * 2 ** 20, 8 * 2 ** 20)
    assert two.cold_s_per_byte == pytest.approx(1 / 1e10 - 1 / 1e11)
    assert two.collectives["all_reduce"] == tuple(LINK) and two.reserved_bytes == 300 * 2 ** 20
    # gloo's threads hide communication only where a core is left for them
    assert not two.overlaps_comm and not four.overlaps_comm and profile.cpu_device(1, path=path).overlaps_comm
    from parallel3d.planner.cost import matmul_seconds, op_time
    import torch
    # a matmul costs what the measured matmul of the same FLOPs took (log-log between points)
    assert op_time(524288.0, 0, 1.0, two, dtype=torch.float32) == pytest.approx(5e-6 + 1e-5)
    assert matmul_seconds(2 * 33554432.0, CURVE) == pytest.approx(4e-4)


def test_a_collective_beside_compute_hides_what_its_threads_leave_idle(tmp_path):
    """Where the ranks fill the cores, a collective the code starts beside compute (ZeRO-2's per-microbatch
    reduce-scatters, its gradient sync) takes a core for its busy share and hides only the rest; a GPU (or
    a spare core) hides all of it, and an unmeasured busy share hides none. Planned on the real dry run of
    tiny at dp2 with ZeRO-2 (per microbatch) and ZeRO-1 (once per step)."""
    sys.path.insert(0, str(ROOT / "launch"))
    from common import stage_builder
    from parallel3d.models.config import ModelConfig
    from parallel3d.planner.cost import hidden_share
    from parallel3d.planner.dryrun import run_role
    from parallel3d.planner.estimate import as_run_on_cpu
    from parallel3d.training.config import load_config
    from parallel3d.training.validate import resolve_and_validate

    path = tmp_path / "hw.json"
    path.write_text(json.dumps(fake_profile(cores=2)))
    serial = profile.cpu_device(2, path=path)
    busy = dataclasses.replace(serial, comm_busy={op: 0.75 for op in profile_gloo.COLLECTIVES})
    assert hidden_share("reduce_scatter", gpu("h100")) == 1.0 and hidden_share("recv", busy) == 0.25
    assert hidden_share("all_gather", serial) == 0.0
    for zero in (2, 1):
        cfg = resolve_and_validate(load_config(str(ROOT / "configs/tiny.yaml"), [
            "parallel.tp=1", f"parallel.zero={zero}", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.seq_len=32", "model.num_layers=2", "parallel.dp=0"], ModelConfig), 2)
        cfg = as_run_on_cpu(cfg)
        runs = {name: run_role(cfg, 1, stage_builder, device, 1) for name, device in (("serial", serial),
                                                                                      ("busy", busy))}
        reduced = runs["busy"].comm_s["dp_cp.reduce_scatter"]
        assert reduced == pytest.approx(runs["serial"].comm_s["dp_cp.reduce_scatter"]) and reduced > 0
        if zero == 2:   # inside each backward: a quarter hides behind its compute
            back = {name: r.actions[("BACKWARD", 0)] for name, r in runs.items()}
            assert back["serial"].overlapped_comm_s == 0.0
            assert back["busy"].overlapped_comm_s == pytest.approx(back["serial"].blocking_comm_s * 0.25)
            assert back["busy"].blocking_comm_s == pytest.approx(back["serial"].blocking_comm_s * 0.75)
        else:           # the step's one gradient sync: a quarter of each bucket may hide behind the last backward
            assert sum(runs["serial"].grad_sync_parts) == 0.0
            assert sum(runs["busy"].grad_sync_parts) == pytest.approx(0.25 * reduced)
            assert runs["busy"].outside.blocking_comm_s == pytest.approx(
                runs["serial"].outside.blocking_comm_s - 0.25 * reduced)


def test_real_profile_measures_this_machine(tmp_path, monkeypatch):
    """The microbenchmarks themselves run (seconds) and give positive rates and both gloo timings; the
    contention probe on the spawned ranks one slowdown per kind, never below 1 (a run cannot be faster than
    alone); and each collective's extra after a long stretch of compute, which the planner is handed. One
    group of processes (CI's time; the median over groups is tested below), and matmul curves up to 256 (the
    bf16 GEMMs at 1024 alone take 10 s here)."""
    monkeypatch.setattr(profile_gloo, "GROUPS", 1)
    monkeypatch.setattr(profile, "MATMUL_SIZES", (32, 64, 128, 256))
    g = profile.cpu_device(2, path=tmp_path / "hw.json")
    assert g.peak_flops["fp32"] > 0 and g.hbm_bytes_per_s > 0 and g.op_overhead_s > 0
    assert g.host_step_params_per_s > 0 and g.reserved_bytes > 0
    assert set(profile_gloo.COLLECTIVES) <= set(g.collectives)
    assert all(a > 0 and b > 0 for a, b in g.collectives.values())
    found = json.loads((tmp_path / "hw.json").read_text())["gloo"]["2"]
    assert set(found["slowdown"]) == {"matmul", "op", "memory"} and min(found["slowdown"].values()) >= 1.0
    assert set(found["wake"]) == set(profile_gloo.COLLECTIVES) and min(found["wake"].values()) >= 0.0
    assert g.comm_wake_s == found["wake"] and g.comm_wake_gap_s == profile_gloo.WAKE_GAP_S
    # the share of a 4 MiB call gloo's threads keep a core busy: measured for every collective
    assert set(found["busy"]) == set(profile_gloo.COLLECTIVES) and g.comm_busy == found["busy"]
    assert all(0.0 < b <= 1.0 for b in found["busy"].values())


def test_gloo_figures_are_the_median_over_groups_of_processes(monkeypatch):
    """Each figure of the workers' reports is the median over the groups of processes, nested as reported:
    one group's slow mode (a 1 KiB all-gather at 1.95 ms against 0.35 and 0.46) does not set the price."""
    reports = [{"times": {"all_gather": [1.95e-3, 4e-3]}, "busy": {"all_gather": 0.7}, "base_rss_bytes": 300},
               {"times": {"all_gather": [0.35e-3, 3e-3]}, "busy": {"all_gather": 0.9}, "base_rss_bytes": 100},
               {"times": {"all_gather": [0.46e-3, 5e-3]}, "busy": {"all_gather": 0.8}, "base_rss_bytes": 200}]
    assert profile_gloo._median_of(reports) == {"times": {"all_gather": [0.46e-3, 4e-3]},
                                                "busy": {"all_gather": 0.8}, "base_rss_bytes": 200}
    spawned = []

    def worker(rank, world, store, out):   # stands for _gloo_worker: one report per group
        spawned.append(store)
        Path(out).write_text(json.dumps({"times": {op: [1e-3 * len(spawned), 2e-3] for op in profile_gloo.COLLECTIVES},
                                         "base_rss_bytes": 1, "together": {"matmul": 1.0, "op": 1.0, "memory": 1.0},
                                         "wake": {}, "busy": {}}))
    import torch.multiprocessing as mp
    monkeypatch.setattr(mp, "start_processes", lambda fn, args, nprocs, start_method: worker(0, *args))
    found = profile_gloo.measure_gloo(2)
    assert len(spawned) == profile_gloo.GROUPS == 3
    small = profile_gloo._solve("send", 2, 2e-3, 2e-3)   # the middle group's 1 KiB time
    assert found["collectives"]["send"][0] == pytest.approx(small[0])


def test_per_op_overhead_of_the_real_step_is_measured():
    """What `launch/plan.py --gpu cpu` measures on a machine without a cached profile: the real Trainer's
    step on a minimal model over its tracked ops (a name clash once broke it for every fresh machine)."""
    sys.path.insert(0, str(ROOT / "launch"))
    from common import stage_builder
    from parallel3d.models.config import ModelConfig
    seconds = profile._step_overhead(stage_builder, ModelConfig())
    assert 0 < seconds < 0.1


def test_one_table_of_gpu_peaks_for_the_planner_and_the_run_mfu():
    from parallel3d.training.metrics import lookup_peak_flops
    for name, device in (("h100", "NVIDIA H100 80GB HBM3"), ("a100", "NVIDIA A100-SXM4-80GB"),
                         ("b200", "NVIDIA B200"), ("h200", "NVIDIA H200")):
        for precision in ("bf16", "tf32", "fp32"):
            assert gpu(name).peak_flops[precision] == lookup_peak_flops(device, precision)


def test_offload_prices_the_host_step_at_the_devices_rate():
    """Item 5: the host step's time is the shard's parameters over the device's stated host rate (one thread
    per rank on a GPU node; measured for --gpu cpu), not a fixed constant."""
    from parallel3d.planner.offload import apply_offload
    from parallel3d.training.config import ExperimentConfig
    from parallel3d.models.config import ModelConfig
    cfg = ExperimentConfig(model=ModelConfig())
    cfg.parallel.offload_optimizer = "cpu"
    memory = {"params": 0, "grads": 0, "optimizer": 12e9, "activations": 0, "comm_buffers": 0, "peak": 20e9}
    for rate in (1.5e8, 3e8):
        device = dataclasses.replace(gpu("h100"), host_step_params_per_s=rate)
        _, moved = apply_offload(cfg, memory, {"optimizer": 12e9, "grads": 4e9}, 0, device)
        assert moved["host_s"] == pytest.approx(1e9 / rate)


def _env(cache_home):
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "XDG_CACHE_HOME": str(cache_home)}


TINY = ["model.num_layers=2", "parallel.tp=2", "parallel.sp=true", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.seq_len=64", "train.eval_interval=0", "checkpoint.interval=0"]


def test_compare_prints_the_plan_beside_a_real_cpu_run(cache_home, tmp_path, capsys):
    """A tiny pretrain run (torchrun, world 2, tp2 with SP, log.timeline on), then `plan.py --gpu cpu
    --compare`: every component appears, and the communication bytes the plan predicts equal the run's."""
    jsonl, timeline = tmp_path / "run.jsonl", tmp_path / "timeline.json"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          "launch/pretrain.py", "--config", "configs/tiny.yaml", *TINY, "train.steps=3",
                          f"log.jsonl={jsonl}", f"log.timeline={timeline}"], cwd=ROOT, env=_env(cache_home),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = subprocess.run([sys.executable, "launch/plan.py", "--config", "configs/tiny.yaml", "--world-size", "2",
                          "--gpu", "cpu", "--compare", str(jsonl), "--timeline", str(timeline), *TINY],
                         cwd=ROOT, env=_env(cache_home), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    for row in ("step time", "step time, middle half of the steps", "pipeline (all microbatches)", "after the pipeline", "one forward action",
                "one backward action", "pipeline bubble", "peak memory (GiB)"):
        assert row in text, text
    after = next(x for x in text.splitlines() if x.startswith("after the pipeline")).split()
    assert float(after[-3]) >= 0.0, after   # the timeline's own step less its span, which lies inside it
    logged = json.loads(jsonl.read_text().splitlines()[-1])["comm_bytes"]
    assert logged and "tp.all_gather" in logged
    for key, nbytes in logged.items():   # bytes are deterministic: the plan's equal the run's
        line = next(x for x in text.splitlines() if x.startswith(f"comm {key} bytes"))
        assert line.split()[-1] == "1.00", line
    from launch import plan as plan_cli   # refused before any dry run, in plan.py's main (as in the command)

    with pytest.raises(SystemExit) as missing:
        plan_cli.main(["--config", "configs/tiny.yaml", "--world-size", "2", "--gpu", "cpu", "--compare",
                       str(tmp_path / "nope.jsonl"), *TINY])
    err = capsys.readouterr().err
    assert missing.value.code == 2 and "--compare" in err and "does not exist" in err


def test_plan_names_an_op_cache_kept_at_another_speed(cache_home):
    """`plan.py --gpu cpu` with an op cache whose reference probe this machine cannot match (a microsecond:
    the cache as if measured on a machine hundreds of times faster) says so on stderr, naming the cache and
    --reprofile, and still plans."""
    from parallel3d.planner import op_replay

    ops = profile.cache_path().with_name(f"ops-{profile.cache_path().name}")
    ops.write_text(json.dumps({"version": op_replay.VERSION, "speed_s": 1e-6, "ops": {}}))
    out = subprocess.run([sys.executable, "launch/plan.py", "--config", "configs/tiny.yaml", "--world-size", "1",
                          "--gpu", "cpu", *TINY[:1], *TINY[3:], "parallel.tp=1"], cwd=ROOT, env=_env(cache_home),
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"note: the op cache {ops}" in out.stderr and "slower now" in out.stderr, out.stderr[-3000:]
    assert "--reprofile" in out.stderr and "step time" in out.stdout


def test_a_run_is_read_at_its_steady_state(tmp_path):
    """`--compare` and the accuracy benchmark read the median of the later half of the steps: a run that
    warms up over three steps (the MoE run's heap growing) is read at its steady 4 s, not 5."""
    from parallel3d.planner.compare import read_run

    jsonl = tmp_path / "run.jsonl"
    steps = [8.4, 6.0, 5.0, 4.1, 4.0, 3.9]
    jsonl.write_text("".join(json.dumps({"step": i, "step_time_s": t, "peak_mem_bytes": 10 + i}) + "\n"
                             for i, t in enumerate(steps)) + json.dumps({"eval_loss": 1.0}) + "\n")
    run = read_run(str(jsonl))
    assert run["steps"] == 6 and run["step_time_s"] == 4.0 and run["peak_mem_bytes"] == 15
    assert run["step_time_q1_s"] == pytest.approx(3.9) and run["step_time_q3_s"] == pytest.approx(4.1)
    jsonl.write_text("".join(json.dumps({"step": i, "step_time_s": t}) + "\n" for i, t in enumerate([9.0, 2.0])))
    assert read_run(str(jsonl))["step_time_s"] == 2.0   # two steps: the second


def test_what_follows_the_pipeline_is_read_from_the_timelines_own_step(tmp_path):
    """The pipeline's span comes from one recorded step; what followed it is that step's time less the
    span, not the steps' median less it (a slow recorded step put it below zero: -12.8 ms of a 103 ms step)."""
    from parallel3d.planner.compare import read_run

    jsonl, timeline = tmp_path / "run.jsonl", tmp_path / "timeline.json"
    jsonl.write_text("".join(json.dumps({"step": i + 1, "step_time_s": t}) + "\n"
                             for i, t in enumerate([0.30, 0.10, 0.10, 0.16, 0.10, 0.10])))
    measured = [[0, "FORWARD", 0, 0, None, 0.0, 0.05], [0, "BACKWARD", 0, 0, None, 0.05, 0.14]]
    timeline.write_text(json.dumps({"step": 4, "measured_bubble": 0.0, "measured": measured}))
    run = read_run(str(jsonl), str(timeline))
    assert run["step_time_s"] == 0.10 and run["pipeline_s"] == pytest.approx(0.14)
    assert run["after_pipeline_s"] == pytest.approx(0.02)   # step 4's 0.16 s, not the median's 0.10
    timeline.write_text(json.dumps({"measured_bubble": 0.0, "measured": measured}))   # no step named
    assert "after_pipeline_s" not in read_run(str(jsonl), str(timeline))
    # log.timeline_steps: the medians over the recorded steps 4-6 (steps 5 and 6 spans 0.08 s, 0.09 s)
    later = [[0, "FORWARD", 0, 0, None, 1.0, 1.03], [0, "BACKWARD", 0, 0, None, 1.03, 1.08]]
    last = [[0, "FORWARD", 0, 0, None, 2.0, 2.04], [0, "BACKWARD", 0, 0, None, 2.04, 2.09]]
    steps = [{"step": 4, "measured_bubble": 0.1, "measured": measured},
             {"step": 5, "measured_bubble": 0.2, "measured": later},
             {"step": 6, "measured_bubble": 0.3, "measured": last}]
    timeline.write_text(json.dumps({"step": 6, "measured_bubble": 0.3, "measured": last, "steps": steps}))
    run = read_run(str(jsonl), str(timeline))
    assert run["timeline_steps"] == 3 and run["pipeline_s"] == pytest.approx(0.09) and run["bubble"] == 0.2
    assert run["after_pipeline_s"] == pytest.approx(0.02)   # of 0.02, 0.02 and 0.01
    assert run["action_s"]["FORWARD"] == pytest.approx((0.05 + 0.03 + 0.04) / 3)


@pytest.mark.sweep   # 434-517 s on this 2-core machine (op replay of two layouts into an empty cache);
# test_compare_prints_the_plan_beside_a_real_cpu_run covers the plan-beside-a-run path in CI
def test_accuracy_benchmark_quick_smoke(cache_home):
    """Two layouts of the --quick benchmark: plans, runs through launch/pretrain.py under torchrun, and the
    JSON rows carry what the issue asks for, with the load average and the commit."""
    out = subprocess.run([sys.executable, "benchmarks/planner_accuracy.py", "--quick", "--steps", "2",
                          "--layouts", "dp2-zero1,pp2-1f1b", "--cached-profile", "--json"], cwd=ROOT,
                         env=_env(cache_home), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["layout"] for r in rows] == ["dp2-zero1", "pp2-1f1b"]
    for r in rows:
        for key in ("predicted_s", "measured_s", "predicted_peak_bytes", "measured_peak_bytes", "ratio",
                    "load_average", "commit"):
            assert key in r, key
        assert r["predicted_s"] > 0 and r["measured_s"] > 0 and r["measured_peak_bytes"] > 0
        assert r["measured_rounds_s"] == [r["measured_s"]]   # --quick: one round
        assert r["measured_q1_s"] <= r["measured_s"] <= r["measured_q3_s"]   # the steps' middle half
    assert "load average" in out.stdout and "orders match" in out.stdout


def test_default_search_of_70b_on_64_gpus_dry_runs_at_most_its_budget(monkeypatch):
    """Issue 27 item 10: the default candidate budget bounds the dry runs (2 per layout asked for) whether
    or not the layouts fit; --max-candidates 0 stays exhaustive."""
    from parallel3d.models.config import ModelConfig
    import importlib
    from parallel3d.planner.estimate import Plan
    from parallel3d.training.config import load_config

    search_module = importlib.import_module("parallel3d.planner.search")  # the package exports search()
    cfg = load_config(str(ROOT / "configs/llama3_70b.yaml"), [], ModelConfig)
    for fits in (False, True):
        calls = []

        def fake_plan(c, *args, **kwargs):
            calls.append(c)
            return Plan(fits=fits, layout={"tp": c.parallel.tp, "pp": c.parallel.pp, "cp": c.parallel.cp,
                                           "ep": c.parallel.ep, "dp": c.parallel.dp, "zero": c.parallel.zero,
                                           "schedule": c.parallel.schedule,
                                           "micro_batch_size": c.train.micro_batch_size,
                                           "activation_checkpointing": c.train.activation_checkpointing},
                        memory={"peak": 1}, step_time_s=1.0, tokens_per_s=float(len(calls)), mfu=0.5,
                        comm_bytes={})
        monkeypatch.setattr(search_module, "plan", fake_plan)
        found = search_module.search(cfg, 64, None, gpu("h100"), 8,
                                     max_candidates=search_module.DEFAULT_MAX_CANDIDATES)
        budget = 2 * search_module.DEFAULT_MAX_CANDIDATES
        assert len(calls) == (budget if not fits else search_module.DEFAULT_MAX_CANDIDATES)
        assert len(found) == (0 if not fits else search_module.DEFAULT_MAX_CANDIDATES)
    assert search_module.dry_run_budget(0, 5000) == 5000


def test_ranks_computing_at_once_are_priced_with_their_measured_slowdown(tmp_path):
    """Ranks share caches, memory bandwidth and maybe physical cores: the probe's slowdown (world processes
    at once against one alone) scales the matmul curves, bandwidth and per-op overhead of that world."""
    plain, slowed = fake_profile(), fake_profile()
    slowed["gloo"]["2"]["slowdown"] = {"matmul": 1.5, "op": 2.0}
    devices = []
    for i, prof in enumerate((plain, slowed)):
        path = tmp_path / f"hw{i}.json"
        path.write_text(json.dumps(prof))
        devices.append(profile.cpu_device(2, path=path))
    a, b = devices
    assert b.op_overhead_s == pytest.approx(2.0 * a.op_overhead_s)
    assert b.hbm_bytes_per_s == pytest.approx(a.hbm_bytes_per_s / 1.5)
    for key in ("fp32", "flash_attention_fwd"):
        assert [s for _, s in b.matmul_curves[key]] == pytest.approx([1.5 * s for _, s in a.matmul_curves[key]])


def test_collectives_are_priced_at_what_a_step_pays_on_average():
    """A step pays every call of a collective: the mean, not the fastest, and not without its slow tail
    (the calls that wait a scheduler tick); only one hiccup of the machine is left out, the slowest call
    (it once fitted all-to-all with a 3.6 ms latency)."""
    assert profile_gloo.typical([1.0, 3.0, 2.0]) == pytest.approx(1.5)
    ticks = [0.5] * 16 + [4.5] * 3 + [500.0]   # 15% of the calls wait a tick, one hiccup
    assert profile_gloo.typical(ticks) == pytest.approx((16 * 0.5 + 3 * 4.5) / 19)
    assert profile_gloo.typical([2.0]) == 2.0


def test_a_layouts_row_is_its_median_round_whole(capsys):
    """planner_accuracy runs the layouts in turn, ROUNDS times: a layout's row is the run whose step time is
    the median of its rounds, with that run's own components (not a mix of runs), and every round's time."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from accuracy_runs import median_round

    runs = [{"measured_s": 0.094, "measured_pipeline_s": 0.080}, {"measured_s": 0.056, "measured_pipeline_s": 0.046},
            {"measured_s": 0.061, "measured_pipeline_s": 0.050}]
    row = median_round(runs)
    assert row["measured_s"] == 0.061 and row["measured_pipeline_s"] == 0.050
    assert row["measured_rounds_s"] == [0.094, 0.056, 0.061]
    assert median_round(runs[:2])["measured_s"] == 0.056   # even: the lower middle
    assert median_round(runs[:1])["measured_rounds_s"] == [0.094]
    from planner_accuracy import main

    for flag in ("--rounds", "--steps"):   # refused before any profile, plan or run
        with pytest.raises(SystemExit) as bad:
            main([flag, "0"])
        assert bad.value.code == 2 and f"{flag} must be at least 1, got 0" in capsys.readouterr().err


def test_gpu_of_a_driver_device_name():
    """planner_accuracy --gpu plans for the GPU the driver names; an unknown one is one clear error."""
    from parallel3d.planner.hardware import gpu_of_device

    assert gpu_of_device("NVIDIA H200") is gpu("h200")
    assert gpu_of_device("NVIDIA H100 80GB HBM3") is gpu("h100")
    with pytest.raises(ValueError, match="no planner GPU for device 'Tesla T4'"):
        gpu_of_device("Tesla T4")


def test_the_dry_run_prices_the_clipping_pass():
    """A run clips whenever the gradients' norm exceeds train.grad_clip, as every step of a short run does: the
    dry run (no values, its nominal norm above any clip) takes that path, one scaling of each bucket's held
    gradients, and grad_clip=0 takes none (the real dry run of tiny, dp2 ZeRO-1)."""
    sys.path.insert(0, str(ROOT / "launch"))
    from common import stage_builder
    from parallel3d.models.config import ModelConfig
    from parallel3d.planner.dryrun import run_role
    from parallel3d.training.config import load_config
    from parallel3d.training.validate import resolve_and_validate

    runs = {}
    for clip in (1.0, 0.0):
        cfg = resolve_and_validate(load_config(str(ROOT / "configs/tiny.yaml"), [
            "parallel.zero=1", "train.global_batch_size=4", "train.micro_batch_size=2", "train.seq_len=32",
            "model.num_layers=2", "parallel.dp=0", "parallel.bucket_size=20000", f"train.grad_clip={clip}"],
            ModelConfig), 2)
        runs[clip] = run_role(cfg, 0, stage_builder, gpu("h100"), 8)
    from parallel3d.planner.dryrun import _context
    from parallel3d.training.trainer import Trainer

    ctx = _context(cfg, 0, "meta", "nccl")
    buckets = len(Trainer(cfg, ctx, stage_builder(cfg, ctx)).optimizer.buckets)
    assert buckets > 1
    mul = {clip: r.op_seconds["mul_"][0] for clip, r in runs.items()}
    assert mul[1.0] - mul[0.0] == buckets, mul


def test_host_step_rate_times_the_offloaded_step_the_code_runs(monkeypatch):
    """profile.host_step_rate times the DistributedOptimizer's own step over host state: the unscale and norm
    (grad_stats), the clipping (its threshold is always exceeded, as the dry run plans) and AdamW, in every
    timed step; no rate figure is asserted."""
    from parallel3d.data_parallel import step
    from parallel3d.planner.profile import host_step_rate

    calls = {"grad_stats": 0, "clip_": 0, "adamw_": 0}

    def counting(name):
        real = getattr(step, name)

        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return wrapper
    for name in calls:
        monkeypatch.setattr(step, name, counting(name))
    assert host_step_rate(1 << 12) > 0
    assert calls["grad_stats"] == calls["clip_"] == 3 and calls["adamw_"] >= 3   # one or more buckets a step
