"""The planner's step time and peak memory against real runs of the same layouts on this machine.

    python benchmarks/planner_accuracy.py [--quick] [--steps N] [--layouts a,b] [--models tiny,llama_100m] [--json]

For each model (configs/tiny.yaml with 4 layers, configs/llama_100m.yaml at a CPU-sized batch) and each
layout of world 2 (dp2 ZeRO-0/1/2/3, tp2 with and without SP, pp2 1F1B and ZB-V, cp2 ring, MoE ep2), it
plans the layout for this machine (`--gpu cpu`: parallel3d/planner/profile.py) and then runs it through
`launch/pretrain.py` under torchrun (2 gloo ranks, one thread each, log.timeline on), and prints:
  - predicted and measured step time (median of the later half of the steps: compare.steady_rows) and
    their ratio, and the middle half of those steps (their first and third quartiles); each model runs for
    its own number of steps (`STEPS`): a tiny step is still warming up over its first five or so (29.7,
    33.9, 28.2, 25.0, 30.7 ms, then 24-28 ms in one dp2 run), and a VM may run at two speeds for seconds
    at a time (RESULTS.md, ninth session), so tiny runs 60 steps and llama_100m, at seconds a step, 6 (its
    MoE layout warms up over three or four);
  - each layout's rounds (`ROUNDS` per model, `--rounds`): the layouts run in turn that many times, and a
    layout's row is its median round, whole (tiny's steps, 50-300 ms, move by about a quarter with the
    VM's speed stretches, which last minutes; three rounds put a layout's runs minutes apart);
  - the pipeline span and what follows it (gradient-sync tail, clipping, optimizer), planned and
    measured (from the run's timeline JSON), so a gross error can be put on a component;
  - predicted peak memory (the plan's worst rank plus the process's resident memory before the model,
    measured by the profile) and measured (rank 0's peak RSS, what a CPU run logs as peak_mem_bytes);
  - the share of a core each rank got during its run (children's CPU seconds over wall seconds x ranks):
    1 on a quiet machine; under load the measured times stretch by about its inverse (a diagnostic only);
  - how far the machine's speed moved: a fixed piece of work timed on every rank's core at once before and
    after each run, the slowest core's, over its time right after the profile (`accuracy_runs.Reference`:
    this VM slows one vCPU at a time, and ranks in lock step meet the slowest; a diagnostic only, the
    ratio is never corrected by it);
  - the MoE layout's routing load (compare.routing_load: its busiest EP rank's share of the routed slots over
    the balanced share, 1.3-1.4 in these short dropless runs from a random router), which the plan assumes
    balanced, and the plan again at that load (`--moe-load`), so the routing is told from the rest;
  - per model, whether the ranking of layouts by predicted time matches the measured ranking, and
    whether the planner's best layout is the measured best or within 10% of it.
The header records the load average (os.getloadavg) before and after, the commit and the profile used:
timings on a shared machine are noisy. `--json`: the last line is one JSON list of the rows.
`--quick`: tiny only, 3 steps, one round (a smoke test). `--steps N` sets every model's steps, `--rounds N`
every model's rounds.

`--gpu`: the same on one CUDA GPU instead (world 1, NCCL): a ~1B Llama in bf16 at seq 2048 with no, selective
and full recomputation, four microbatches, and the optimizer offloaded to the host; planned for the GPU
`torch.cuda.get_device_name()` names (parallel3d/planner/hardware.py) and compared on tensor memory
(torch.cuda.max_memory_allocated, the CUDA context excluded, against the plan's peak without its reserve).
First it measures this host (`--table-host` keeps the table's figures): the issue time per op
(`GPU.host_op_s` inside the pipeline's actions, `host_step_op_s` outside them; cost.queue_seconds) from
the accum4 layout at width 128, whose kernels are far shorter than their issue, run for real: its pipeline
and the rest of its step over the ops its dry run counts in each; and the offloaded optimizer step's host
rate on one thread (profile.host_step_rate).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch"))

import torch  # noqa: E402
from accuracy_runs import Reference, commit, measure, median_round, ranking  # noqa: E402
from common import stage_builder  # noqa: E402
from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.planner.compare import steady_rows  # noqa: E402
from parallel3d.planner.dryrun import run_role  # noqa: E402
from parallel3d.planner.estimate import plan  # noqa: E402
from parallel3d.planner.hardware import gpu_of_device  # noqa: E402
from parallel3d.planner.op_replay import speed_note  # noqa: E402
from parallel3d.planner.profile import cache_path, cpu_device, host_step_rate  # noqa: E402
from parallel3d.training.config import load_config  # noqa: E402
from parallel3d.training.validate import resolve_and_validate  # noqa: E402

WORLD = 2
LAYOUTS = {
    "dp2-zero0": ["parallel.tp=1", "parallel.zero=0"],
    "dp2-zero1": ["parallel.tp=1", "parallel.zero=1"],
    "dp2-zero2": ["parallel.tp=1", "parallel.zero=2"],
    "dp2-zero3": ["parallel.tp=1", "parallel.zero=3"],
    "tp2": ["parallel.tp=2", "parallel.sp=false", "parallel.zero=0"],
    "tp2-sp": ["parallel.tp=2", "parallel.sp=true", "parallel.zero=0"],
    "pp2-1f1b": ["parallel.tp=1", "parallel.pp=2", "parallel.schedule=1f1b", "parallel.zero=0"],
    "pp2-zbv": ["parallel.tp=1", "parallel.pp=2", "parallel.schedule=zb-v", "parallel.virtual_stages=2",
                "parallel.zero=0"],
    "cp2-ring": ["parallel.tp=1", "parallel.cp=2", "parallel.cp_mode=ring", "parallel.zero=0"],
    "ep2-moe": ["parallel.tp=1", "parallel.ep=2", "parallel.zero=0", "model.num_experts=4", "model.moe_top_k=2"],
}
MODELS = {
    "tiny": ("configs/tiny.yaml", ["model.num_layers=4"]),
    "llama_100m": ("configs/llama_100m.yaml", ["train.global_batch_size=8", "train.micro_batch_size=2",
                                               "train.seq_len=128"]),
}
GPU_LAYOUTS = {  # world 1 on one GPU
    "none": ["train.activation_checkpointing=none"],
    "selective": ["train.activation_checkpointing=selective"],
    "full": ["train.activation_checkpointing=full"],
    "accum4": ["train.activation_checkpointing=selective", "train.micro_batch_size=2"],
    "offload": ["train.activation_checkpointing=selective", "parallel.offload_optimizer=cpu"],
}
GPU_MODELS = {
    "llama_1b": ("configs/llama_100m.yaml", [
        "model.hidden_size=2048", "model.num_layers=16", "model.num_heads=16", "model.num_kv_heads=8",
        "model.ffn_hidden_size=5632", "model.max_seq_len=2048", "train.seq_len=2048", "train.precision=bf16",
        "train.micro_batch_size=8", "train.global_batch_size=8", "parallel.tp=1", "parallel.zero=0"]),
}
STEPS = {"tiny": 60, "llama_100m": 6}   # per model (module docstring); --steps overrides
ROUNDS = {"tiny": 3, "llama_100m": 1}   # runs per layout, round-robin (module docstring); --rounds overrides
HOST_PROBE = ["model.hidden_size=128", "model.num_heads=2", "model.num_kv_heads=1", "model.ffn_hidden_size=256"]
COMMON = ["train.eval_interval=0", "checkpoint.interval=0", "checkpoint.save_dir=null", "log.interval=1",
          "train.warmup_steps=1", "parallel.dp=0"]




def predict(config: str, overrides: list[str], gpu, world: int = WORLD, expert_load: float = 1.0) -> dict:
    cfg = resolve_and_validate(load_config(str(ROOT / config), overrides, ModelConfig), world)
    t0 = time.perf_counter()
    result = plan(cfg, stage_builder, gpu, cfg.parallel.gpus_per_node, expert_load=expert_load)
    b = result.breakdown
    return {"predicted_s": result.step_time_s, "predicted_pipeline_s": b["pipeline_s"],
            "predicted_after_s": b["outside_actions_s"], "predicted_bubble": result.bubble,
            "predicted_peak_bytes": int(result.memory["peak"] + gpu.reserved_bytes),
            "predicted_tensor_peak_bytes": int(result.memory["peak"]),
            "predicted_shares": b["shares"], "plan_s": time.perf_counter() - t0, "ep": cfg.parallel.ep}






def measure_host(gpu, steps: int, tmp: Path):
    """`gpu` with this machine's host rates (see the module docstring): the issue time per dry-run op inside
    the pipeline's actions and outside them, from the probe's timeline, and the offloaded optimizer step's
    host rate."""
    config, extra = GPU_MODELS["llama_1b"]
    overrides = COMMON + extra + GPU_LAYOUTS["accum4"] + HOST_PROBE
    cfg = resolve_and_validate(load_config(str(ROOT / config), overrides, ModelConfig), 1)
    run = run_role(cfg, 0, stage_builder, gpu, cfg.parallel.gpus_per_node)
    outside = run.outside.ops
    inside = sum(count for count, _ in run.op_seconds.values()) - outside
    row = measure(config, overrides, steps, tmp, "host-probe", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as a torchrun rank runs the offloaded step
    try:
        host_step = host_step_rate()
    finally:
        torch.set_num_threads(threads)
    print(f"host: the width-128 probe's pipeline {row['measured_pipeline_s'] * 1e3:.1f} ms over {inside:.0f} ops "
          f"({row['measured_pipeline_s'] / inside * 1e6:.1f} us per op), after it {row['measured_after_s'] * 1e3:.1f} "
          f"ms over {outside:.0f} ops ({row['measured_after_s'] / outside * 1e6:.1f} us); the table's "
          f"{gpu.host_op_s * 1e6:.1f} / {gpu.host_step_op_s * 1e6:.1f} us; the offloaded optimizer step on the host "
          f"{host_step / 1e6:.0f} M params/s per thread (the table's {gpu.host_step_params_per_s / 1e6:.0f})",
          flush=True)
    return dataclasses.replace(gpu, host_op_s=row["measured_pipeline_s"] / inside,
                               host_step_op_s=row["measured_after_s"] / outside, host_step_params_per_s=host_step)


def cuda_device():
    """The planner's GPU for this machine's CUDA device, by the name the driver reports."""
    return gpu_of_device(torch.cuda.get_device_name())






def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny only, 3 steps (smoke test)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default: STEPS per model, 6 on "
                                                             "the GPU; --quick 3)")
    ap.add_argument("--rounds", type=int, default=None, help="runs per layout, the layouts in turn (default: "
                                                              "ROUNDS per model; --quick and --gpu 1)")
    ap.add_argument("--layouts", default=None, help=f"comma-separated subset of {', '.join(LAYOUTS)}")
    ap.add_argument("--models", default=None, help=f"comma-separated subset of {', '.join(MODELS)}")
    ap.add_argument("--cached-profile", action="store_true",
                    help="use the cached profile of this machine (default: measure it again first, under the "
                         "same conditions as the runs)")
    ap.add_argument("--gpu", action="store_true", help="world 1 on this machine's CUDA GPU (module docstring)")
    ap.add_argument("--table-host", action="store_true",
                    help="--gpu: keep the GPU table's host rates instead of measuring this host's first")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    steps = args.steps or (3 if args.quick else None)
    all_models, all_layouts = (GPU_MODELS, GPU_LAYOUTS) if args.gpu else (MODELS, LAYOUTS)
    models = args.models.split(",") if args.models else (["tiny"] if args.quick else list(all_models))
    layouts = args.layouts.split(",") if args.layouts else list(all_layouts)
    for flag, value in (("--rounds", args.rounds), ("--steps", args.steps)):
        if value is not None and value < 1:
            ap.error(f"{flag} must be at least 1, got {value}")
    for name in layouts:
        if name not in all_layouts:
            ap.error(f"--layouts: unknown layout {name!r}; known: {', '.join(all_layouts)}")
    for name in models:
        if name not in all_models:
            ap.error(f"--models: unknown model {name!r}; known: {', '.join(all_models)}")
    if args.gpu:
        if not torch.cuda.is_available():
            ap.error("--gpu: no CUDA device here")
        world, gpu, profile = 1, cuda_device(), "the GPU table"
    else:
        world, profile = WORLD, cache_path()
        gpu = cpu_device(WORLD, reprofile=not args.cached_profile, builder=(stage_builder, ModelConfig()))
        note = speed_note(gpu.op_times)   # a cached profile's op times against this machine now (run V1)
        if note:
            print(note, flush=True)
    speed_now = Reference(world)   # the fixed work on every rank's core at once, the slowest's time
    load_before, reference = os.getloadavg(), speed_now()
    print(f"planner accuracy, world {world}, commit {commit()}, {gpu.name}, profile {profile}, "
          f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} (1/5/15 min), reference "
          f"work {reference * 1e3:.1f} ms on {world} cores at once (accuracy_runs.Reference)", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.gpu and not args.table_host:
            gpu = measure_host(gpu, steps or 6, Path(tmp))
        for model in models:
            config, extra = all_models[model]
            rounds = args.rounds or (1 if args.quick or args.gpu else ROUNDS.get(model, 1))
            plans: dict = {}
            for name in layouts:
                overrides = COMMON + extra + all_layouts[name]
                try:
                    plans[name] = {"model": model, "layout": name, "overrides": overrides,
                                   **predict(config, overrides, gpu, world)}
                except (RuntimeError, ValueError) as e:  # one failing layout must not lose the others' rows
                    print(f"{model} {name}: the plan FAILED: {e}", flush=True)
            runs: dict = {name: [] for name in plans}
            # the layouts in turn, `rounds` times: a stretch of minutes at one speed of the VM falls on
            # different layouts' rounds, and each layout's median round is its row
            for turn in range(rounds):
                for name, planned in plans.items():
                    try:
                        before = speed_now()
                        n = steps or STEPS.get(model, 6)
                        # on the CPU the timeline records the steady steps the step time is read from; a
                        # GPU's recorded step drains the queue per action, so there it records one
                        recorded = 1 if args.gpu else len(steady_rows(list(range(n))))
                        run = measure(config, planned["overrides"], n, Path(tmp), f"{model}-{name}-{turn}",
                                      world, planned["ep"], timeline_steps=recorded)
                    except (RuntimeError, ValueError) as e:
                        print(f"{model} {name}: the run FAILED: {e}", flush=True)
                        continue
                    run["drift"] = (before + speed_now()) / 2 / reference  # before and after the run
                    runs[name].append(run)
                    if rounds > 1:
                        print(f"{model} {name} round {turn + 1}/{rounds}: {run['measured_s'] * 1e3:.1f} ms "
                              f"(reference work {run['drift']:.2f}x)", flush=True)
            for name in (name for name in plans if runs[name]):
                rows.append(_row(plans[name], runs[name], config, gpu, world, args.gpu))
                _print_row(rows[-1])
    speed_now.close()
    summary = {}
    for model in models:
        if not any(r["model"] == model for r in rows):
            continue
        summary[model] = ranking([r for r in rows if r["model"] == model])
        s = summary[model]
        within = [abs(r["ratio"] - 1) <= 0.25 for r in rows if r["model"] == model]
        print(f"{model}: {sum(within)}/{len(within)} within 25%; predicted order {' < '.join(s['predicted_order'])}; "
              f"measured order {' < '.join(s['measured_order'])}; orders match: {s['orders_match']}; the "
              f"planner's best ({s['planner_best']}) runs at {s['planner_best_vs_measured_best']:.2f}x the "
              f"measured best ({s['measured_best']})")
    load_after = os.getloadavg()
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    if args.json:
        for r in rows:
            r["commit"] = commit()
        print(json.dumps(rows))
    return 0


def _row(planned: dict, runs: list[dict], config: str, gpu, world: int, on_gpu: bool) -> dict:
    """A layout's row: its plan and its median round, the ratio, and the plan again at the routing load
    the run logged where its MoE was uneven."""
    row = {**planned, **median_round(runs)}
    if row.get("moe_load", 1.0) > 1.0:
        try:
            again = predict(config, row["overrides"], gpu, world, min(row["moe_load"], row["ep"]))
            row.update({f"{k}_at_run_load": again[k] for k in ("predicted_s", "predicted_pipeline_s",
                                                                  "predicted_after_s")})
            row["ratio_at_run_load"] = row["measured_s"] / row["predicted_s_at_run_load"]
        except (RuntimeError, ValueError) as e:
            print(f"{row['model']} {row['layout']}: the plan at the run's routing load FAILED: {e}", flush=True)
    if on_gpu:  # the CUDA context is outside max_memory_allocated: compare tensors with tensors
        row["predicted_peak_bytes"] = row["predicted_tensor_peak_bytes"]
    row["ratio"] = row["measured_s"] / row["predicted_s"]
    row["load_average"] = os.getloadavg()[0]
    return row


def _print_row(r: dict) -> None:
    def ms(x):
        return "-" if x is None else f"{1000 * x:.1f}"
    print(f"{r['model']:<10} {r['layout']:<10} step predicted {ms(r['predicted_s'])} ms, measured "
          f"{ms(r['measured_s'])} ms (middle half {ms(r['measured_q1_s'])}-{ms(r['measured_q3_s'])}; rounds "
          f"{'/'.join(ms(x) for x in r['measured_rounds_s'])}), measured/predicted {r['ratio']:.2f} | pipeline {ms(r['predicted_pipeline_s'])}"
          f" / {ms(r.get('measured_pipeline_s'))} ms, after it {ms(r['predicted_after_s'])} / "
          f"{ms(r.get('measured_after_s'))} ms | peak {r['predicted_peak_bytes'] / 2**20:.0f} / "
          f"{r['measured_peak_bytes'] / 2**20:.0f} MiB (tensors {r['predicted_tensor_peak_bytes'] / 2**20:.1f}) "
          f"| plan took {r['plan_s']:.1f} s | load {r['load_average']:.1f}, each rank got {r['cpu_share']:.0%} of a core "
          f"(measured x that: {ms(r['measured_s'] * r['cpu_share'])} ms) | the reference work on its cores took "
          f"{r['drift']:.2f}x its time after the profile", flush=True)
    if "ratio_at_run_load" in r:
        print(f"{'':<10} {'':<10} the run routed its busiest EP rank {r['moe_load']:.2f}x the balanced share (the "
              f"plan: 1.00x); planned at that load: {ms(r['predicted_s_at_run_load'])} ms, measured/predicted "
              f"{r['ratio_at_run_load']:.2f} | pipeline {ms(r['predicted_pipeline_s_at_run_load'])} ms, after it "
              f"{ms(r['predicted_after_s_at_run_load'])} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
