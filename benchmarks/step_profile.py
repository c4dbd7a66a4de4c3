"""Where one training step's time goes, from torch.profiler: the kernels (or CPU ops) by total time, how busy
the device was over the step, and how many kernels ran. The diagnostic behind the planner's per-component
comparison when a whole step is off (benchmarks/planner_accuracy.py --gpu).

    python benchmarks/step_profile.py [--model llama_1b] [--layout selective] [--steps 3] [--top 20]

World 1 on this machine's device (CUDA when present), the real Trainer, the model and layout names of
planner_accuracy.py (--gpu's on a GPU, else tiny with its CPU layouts' overrides where they apply).
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
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    models = pa.GPU_MODELS if cuda else pa.MODELS
    model = args.model or next(iter(models))
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
    print(events.table(sort_by=key, row_limit=args.top), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
