"""Where one training step's time goes, from torch.profiler: the kernels (or CPU ops) by total time, how busy
the device was over the step, and how many kernels ran. The diagnostic behind the planner's per-component
comparison when a whole step is off (benchmarks/planner_accuracy.py --gpu).

    python benchmarks/step_profile.py [--model llama_1b] [--layout selective] [--steps 3] [--top 20] [--plan]
                                      [--sort device|cpu]

World 1 on this machine's device (CUDA when present), the real Trainer, the model and layout names of
planner_accuracy.py (--gpu's on a GPU, else tiny with its CPU layouts' overrides where they apply).
`--plan` also dry-runs the same step for this machine (the GPU's datasheet figures, or the CPU's measured
profile) and sets the planner's seconds per op beside the profile's, op by op: where the time model is off.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "launch"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def main(argv=None) -> int:
    import planner_accuracy as pa
    from common import stage_builder
    from parallel3d.mesh import ParallelContext
    from parallel3d.models.config import ModelConfig
    from parallel3d.training.config import load_config
    from parallel3d.training.trainer import Trainer
    from parallel3d.training.validate import resolve_and_validate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model of planner_accuracy.py (GPU_MODELS on CUDA)")
    ap.add_argument("--layout", default="selective", help="a layout of planner_accuracy.py's GPU_LAYOUTS")
    ap.add_argument("--steps", type=int, default=3, help="warm-up steps before the profiled one")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--override", nargs="*", default=[], help="extra key=value overrides")
    ap.add_argument("--plan", action="store_true", help="the planner's seconds per op beside the profile's")
    ap.add_argument("--sort", choices=("device", "cpu"), default="device",
                    help="order ops by device time (a GPU's default) or by host self time (where the host sets "
                         "the pace: optimizer offload)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda:
        torch.set_num_threads(1)   # as a torchrun rank runs, and as the planner's CPU profile is measured
    models = pa.GPU_MODELS if cuda else pa.MODELS
    model = args.model or next(iter(models))
    if model not in models or args.layout not in pa.GPU_LAYOUTS:
        ap.error(f"--model {model!r} / --layout {args.layout!r}: known models {', '.join(models)}, "
                 f"layouts {', '.join(pa.GPU_LAYOUTS)}")
    config, extra = models[model]
    overrides = pa.COMMON + extra + pa.GPU_LAYOUTS[args.layout] + (["parallel.tp=1"] if not cuda else []) \
        + args.override
    cfg = resolve_and_validate(load_config(os.path.join(ROOT, config), overrides, ModelConfig), 1)
    ctx = ParallelContext.single(device)
    trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx))
    for _ in range(args.steps):
        trainer.train_step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    trainer.train_step()
    sync()
    wall = time.perf_counter() - t0
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        trainer.train_step()
        sync()
    events = prof.key_averages()
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    busy = sum(getattr(e, key) for e in events) / 1e6
    kernels = sum(e.count for e in events if cuda and getattr(e, "self_device_time_total", 0) > 0)
    print(f"{model} {args.layout} on {torch.cuda.get_device_name() if cuda else 'cpu'}: step {wall * 1e3:.1f} ms "
          f"unprofiled; {'device busy' if cuda else 'CPU op time'} {busy * 1e3:.1f} ms in the profiled step"
          + (f" over {kernels} kernels" if cuda else ""), flush=True)
    print(events.table(sort_by=key if args.sort == "device" else "self_cpu_time_total", row_limit=args.top),
          flush=True)
    if args.plan:
        print(per_op_table(cfg, events, cuda, args.top), flush=True)
    return 0


def measured_seconds(events, cuda: bool) -> dict:
    """Profiled seconds per op name as the planner's tracker names them (`mm`, `rmsnorm_fwd`): aten ops'
    self time; our custom ops' total (on the CPU their interpreted kernels run inside them)."""
    out: dict = {}
    for e in events:
        ns, _, name = e.key.partition("::")
        if ns not in ("aten", "parallel3d") or not name:
            continue
        if cuda:
            us = e.device_time_total
        else:
            us = e.cpu_time_total if ns == "parallel3d" else e.self_cpu_time_total
        count, seconds = out.get(name, (0, 0.0))
        out[name] = (count + e.count, seconds + us / 1e6)
    return out


def per_op_table(cfg, events, cuda: bool, top: int) -> str:
    """The planner's modeled seconds per op (world 1, rank 0) beside the profile's, largest measured first."""
    import planner_accuracy as pa
    from common import stage_builder
    from parallel3d.models.config import ModelConfig
    from parallel3d.planner.dryrun import run_role
    from parallel3d.planner.profile import cpu_device

    gpu = pa.cuda_device() if cuda else cpu_device(1, builder=(stage_builder, ModelConfig()))
    from parallel3d.planner.host_kernels import as_run_on_cpu
    planned = run_role(cfg if cuda else as_run_on_cpu(cfg), 0, stage_builder, gpu, 1).op_seconds
    measured = measured_seconds(events, cuda)
    names = sorted(set(planned) | set(measured), key=lambda n: -measured.get(n, (0, 0.0))[1])
    lines = [f"per op, planned for {gpu.name} vs profiled (ms; count planned / profiled):",
             f"{'op':<34} {'planned':>9} {'profiled':>9} {'prof/plan':>9} {'count':>13}"]
    total_p = sum(v[1] for v in planned.values())
    total_m = sum(measured.get(n, (0, 0.0))[1] for n in planned)
    for n in names[:top]:
        pc, ps = planned.get(n, (0, 0.0))
        mc, ms = measured.get(n, (0, 0.0))
        ratio = f"{ms / ps:9.2f}" if ps else f"{'-':>9}"
        lines.append(f"{n:<34} {ps * 1e3:9.2f} {ms * 1e3:9.2f} {ratio} {pc:>6} / {mc:<6}")
    lines.append(f"{'all ops the planner prices':<34} {total_p * 1e3:9.2f} {total_m * 1e3:9.2f} "
                 f"{total_m / total_p if total_p else 0:9.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
