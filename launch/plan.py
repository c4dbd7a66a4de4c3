"""Plan a layout before spending a GPU-hour: the real training step dry-run on one CPU (no torchrun).

    python launch/plan.py --config configs/llama3_70b.yaml --world-size 64 [--gpu h100|cpu] \\
        [--gpus-per-node 8] [key=value ...] [--json] [--search [--max-candidates N]] \\
        [--compare run.jsonl [--timeline timeline.json]] [--moe-load F] [--reprofile]

Builds and steps one rank of each role of the layout on the `meta` stand-in device (parallel3d/planner),
then prints memory per rank (parameters, gradients, optimizer state, activations, communication buffers),
step time, tokens/s, MFU and bytes per group. `--json`: the last stdout line is one JSON object.
`--search`: the valid layouts for the world size (parallel3d/planner/search.py) in a cheap analytic order,
dry-run until `--max-candidates` (default 8) fit, best first (with `--json`: the last line is a JSON list);
`--max-candidates 0` dry-runs every valid layout. A progress line goes to stderr.
`--gpu cpu`: this machine, measured by short microbenchmarks the first time and cached
(parallel3d/planner/profile.py; `--reprofile` measures again).
`--compare run.jsonl`: the plan beside a real run of the same config and overrides, per component
(parallel3d/planner/compare.py); `--timeline` adds the run's log.timeline JSON. Of a dropless MoE at EP > 1
it also prints the run's routing load (the busiest EP rank's share of the routed slots over the balanced
share); a plan assumes balanced routing unless `--moe-load F` plans that rank at F times its share.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import fail, stage_builder  # noqa: E402
from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.expert_parallel.dispatch import check_expert_load  # noqa: E402
from parallel3d.planner.dryrun import DryRunError  # noqa: E402
from parallel3d.planner.compare import read_run, table as compare_table  # noqa: E402
from parallel3d.planner.estimate import MEMORY_KEYS, Plan, plan  # noqa: E402
from parallel3d.planner.hardware import GPUS, gpu as find_gpu  # noqa: E402
from parallel3d.planner.search import DEFAULT_MAX_CANDIDATES, search  # noqa: E402
from parallel3d.training.config import ConfigError, load_config  # noqa: E402
from parallel3d.training.validate import resolve_and_validate  # noqa: E402

GiB = 2 ** 30


def _table(result: Plan, gpu, world: int) -> str:
    lay = result.layout
    lines = ["layout: " + " ".join(f"{k}={v}" for k, v in lay.items()) + f"  (world {world}, {gpu.name})",
             "memory of the worst rank (GiB): " + "  ".join(
                 f"{k} {result.memory[k] / GiB:.2f}" for k in MEMORY_KEYS),
             f"fits: {'yes' if result.fits else 'NO'} (peak vs the device's memory less "
             f"{gpu.reserved_bytes / GiB:.2f} GiB for " + ("the process before the model: Python, torch, gloo)"
                                                          if gpu.matmul_curves else
                                                          "the CUDA context, workspaces and NCCL buffers)"),
             f"step time {result.step_time_s:.3f} s   tokens/s {result.tokens_per_s:,.0f}   "
             f"MFU {100 * result.mfu:.1f}%   pipeline bubble {100 * result.bubble:.1f}%"]
    b = result.breakdown
    lines.append(f"  pipeline {b['pipeline_s']:.3f} s + outside the pipeline (grad sync tail, optimizer) "
                 f"{b['outside_actions_s']:.3f} s; per microbatch: compute {b['compute_per_microbatch_s']:.4f} s, "
                 f"blocking comm {b['blocking_comm_per_microbatch_s']:.4f} s")
    if b.get("host_stall_per_microbatch_s"):
        lines.append(f"  of that compute, {b['host_stall_per_microbatch_s']:.4f} s per microbatch waits for the host "
                     f"to issue ops (planner/cost.py queue_seconds): small kernels, host-bound")
    off = b.get("offload") or {}
    if off.get("host_bytes") or off.get("exposed_s"):
        lines.append(f"  offload: {off['host_bytes'] / GiB:.2f} GiB in host memory, {off['exposed_s']:.3f} s per step "
                     f"of PCIe / host optimizer step / NVMe time not hidden (parallel3d/planner/offload.py)")
    lines.append("  share of the step: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in b["shares"].items()))
    for kernel, d in sorted(b.get("derated_kernels", {}).items()):
        lines.append(f"  kernel {kernel}: {d['warps_per_sm']} warps per SM (theoretical occupancy, "
                     f"kernel_report) -> its roofline time / {d['factor']:.2f}")
    for role in result.roles:
        mem = role["memory"]
        lines.append(f"  pp stage {role['pp_rank']} (rank {role['rank']}): peak {mem['peak'] / GiB:.2f} GiB, "
                     f"activations {mem['activations'] / GiB:.2f} GiB at {role['in_flight']} microbatches in flight")
    lines.append("bytes per step by group.op: " + ", ".join(
        f"{k} {v / 1e9:.2f} GB" for k, v in sorted(result.comm_bytes.items())))
    lines.extend(f"note: {n}" for n in result.notes)
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Dry-run a layout (or search all of them) on one CPU.")
    parser.add_argument("--config", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--gpu", default="h100", help=f"one of {', '.join(GPUS)}, or cpu (this machine, measured)")
    parser.add_argument("--reprofile", action="store_true", help="--gpu cpu: measure this machine again")
    parser.add_argument("--compare", metavar="RUN_JSONL", help="a real run's log.jsonl to print beside the plan")
    parser.add_argument("--timeline", metavar="TIMELINE_JSON", help="--compare: the run's log.timeline .json")
    parser.add_argument("--gpus-per-node", type=int, default=None,
                        help="GPUs per node (NVLink domain); default parallel.gpus_per_node (8)")
    parser.add_argument("--moe-load", type=float, default=1.0, metavar="F",
                        help="dropless MoE at EP > 1: plan the busiest EP rank, whose experts receive F times the "
                             "balanced share of the routed rows (a run logs it: --compare); default 1 (balanced)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--search", action="store_true")
    parser.add_argument("--max-candidates", type=int, default=DEFAULT_MAX_CANDIDATES,
                        help="--search: dry-run the layouts in the analytic prior's order until this many fit "
                             f"(at most 2x as many dry runs; default {DEFAULT_MAX_CANDIDATES}); 0: dry-run every valid layout")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come before or after options
    try:
        gpu = None if args.gpu.lower() == "cpu" else find_gpu(args.gpu)
        for flag, path in (("--compare", args.compare), ("--timeline", args.timeline)):
            if path and not os.path.isfile(path):
                raise ConfigError(f"{flag} {path}: the file does not exist")
        if args.timeline and not args.compare:
            raise ConfigError("--timeline goes with --compare RUN_JSONL (the run it belongs to)")
        if not os.path.isfile(args.config):
            raise ConfigError(f"config file {args.config} does not exist")
        overrides = list(args.overrides)
        if args.gpus_per_node is not None:  # one owner: the mesh's node size (hpZ groups) is the planner's
            overrides.append(f"parallel.gpus_per_node={args.gpus_per_node}")
        cfg = load_config(args.config, overrides, ModelConfig)
        if args.search and args.moe_load != 1.0:   # both before any profiling
            raise ConfigError("--moe-load plans one layout's routing; --search compares layouts at balanced routing")
        check_expert_load(args.moe_load, cfg.parallel.ep, cfg.model.capacity_factor)
        if gpu is None:  # this machine, measured once and cached (the config is checked first)
            from parallel3d.planner.op_replay import speed_note
            from parallel3d.planner.profile import cpu_device
            gpu = cpu_device(args.world_size, reprofile=args.reprofile, builder=(stage_builder, ModelConfig()))
            note = speed_note(gpu.op_times)   # the cached op times against this machine's speed now
            if note:
                print(note, file=sys.stderr)
        args.gpus_per_node = cfg.parallel.gpus_per_node
        if args.search:
            results = search(cfg, args.world_size, stage_builder, gpu, args.gpus_per_node,
                             max_candidates=args.max_candidates, progress=sys.stderr)
            for r in results[:10]:
                print(_table(r, gpu, args.world_size), end="\n\n")
            if not results:
                print(f"no layout of world size {args.world_size} fits on {gpu.name}")
            if args.json:
                print(json.dumps([r.to_json() for r in results]))
            return
        cfg = resolve_and_validate(cfg, args.world_size)
        run = read_run(args.compare, args.timeline, cfg.parallel.ep) if args.compare else None
        simulated = (run or {}).get("simulated")
        if simulated and simulated["world_size"] != args.world_size:
            raise ConfigError(f"--compare {args.compare} simulated rank {simulated['rank']} of world size "
                              f"{simulated['world_size']}; plan it at --world-size {simulated['world_size']}")
        result = plan(cfg, stage_builder, gpu, args.gpus_per_node, expert_load=args.moe_load)
    except (ConfigError, ValueError, DryRunError) as e:
        fail(str(e))
    print(_table(result, gpu, args.world_size))
    if run is not None:
        recorded = run.get("timeline_steps")
        timed = f"; the pipeline rows over the timeline's {recorded} recorded step{'s' * (recorded > 1)}" if recorded else ""
        print(f"\nplan beside the run {args.compare} ({run['steps']} steps; medians of the later half{timed}):")
        # what the run's peak_mem_bytes holds besides tensors: a CPU run logs its peak RSS (the process before
        # the model included), a CUDA run torch.cuda.max_memory_allocated (the CUDA context outside it)
        print(compare_table(result, run, gpu.reserved_bytes if gpu.runs_cpu_kernels else 0.0))
        if abs(run.get("moe_load", result.expert_load) - result.expert_load) > 0.05:
            print(f"the run routed its busiest EP rank {run['moe_load']:.2f}x the balanced share; the plan assumed "
                  f"{result.expert_load:.2f}x: plan again with --moe-load {run['moe_load']:.2f} to put the rest of "
                  f"the gap on other components")
    if args.json:
        print(json.dumps(result.to_json()))


if __name__ == "__main__":
    main()
