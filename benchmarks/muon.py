"""Muon against AdamW: a step's time and optimizer memory at world size 1 and dp2, and the loss after N steps.

    python benchmarks/muon.py [--preset tiny] [--what loss time] [--steps 60] [--lrs 3e-4,1e-3,3e-3]
                              [--time-steps 5] [--zero 1] [key=value ...]

loss: the real Trainer at world size 1 on the built-in synthetic demo data (data.path unset), train.steps
=N, constant lr, one row per (optimizer, lr): the first, the middle and the last step's loss. Muon uses
train.muon_adjust_lr_fn=match_rms_adamw (the default), so one lr serves both groups.
time: seconds per Trainer step (mean of --time-steps after 2 warm-up steps) and the optimizer state's
bytes on one rank (DistributedOptimizer.memory_bytes()["optimizer"]) at world size 1 and dp2 (gloo
world, ZeRO --zero), for AdamW and Muon (bf16 iteration). Timing needs an idle machine; `memory` runs
one step and reports the bytes alone.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

PRESETS = {"tiny": "configs/tiny.yaml", "100m": "configs/llama_100m.yaml"}


def _trainer(preset: str, overrides: list[str], worker=None):
    from ckpt_helpers import build_trainer, context_for
    from parallel3d.models.config import ModelConfig
    from parallel3d.training.config import load_config
    from parallel3d.training.validate import resolve_and_validate

    cfg = resolve_and_validate(load_config(PRESETS[preset], overrides, ModelConfig),
                               1 if worker is None else worker.world_size)
    return build_trainer(cfg, context_for(cfg, worker))


def losses(preset: str, optimizer: str, lr: float, steps: int, extra: list[str]) -> list[float]:
    torch.set_num_threads(1)
    t = _trainer(preset, ["parallel.tp=1", f"train.optimizer={optimizer}", f"train.lr={lr}",
                          f"train.steps={steps}", "train.lr_schedule=constant", "train.warmup_steps=0", *extra])
    return [t.train_step()["loss"] for _ in range(steps)]


def step_time(worker, preset: str, optimizer: str, zero: int, steps: int) -> dict:
    torch.set_num_threads(1)
    t = _trainer(preset, ["parallel.tp=1", f"train.optimizer={optimizer}", f"parallel.zero={zero}"], worker)
    for _ in range(2 if steps else 1):
        t.train_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        t.train_step()
    return {"s": (time.perf_counter() - t0) / steps if steps else float("nan"),
            "optimizer_bytes": t.optimizer.memory_bytes()["optimizer"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--what", nargs="+", default=["loss"], choices=["loss", "time", "memory"])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lrs", default="3e-4,1e-3,3e-3")
    ap.add_argument("--time-steps", type=int, default=5)
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="key=value for the loss runs (e.g. train.seq_len=64)")
    a = ap.parse_args()
    if "loss" in a.what:
        print(f"| optimizer | lr | loss step 1 | step {a.steps // 2} | step {a.steps} |")
        print("|---|---|---|---|---|")
        for lr in (float(x) for x in a.lrs.split(",")):
            for opt in ("adamw", "muon"):
                ls = losses(a.preset, opt, lr, a.steps, a.overrides)
                print(f"| {opt} | {lr:g} | {ls[0]:.4f} | {ls[a.steps // 2 - 1]:.4f} | {ls[-1]:.4f} |", flush=True)
    if "time" in a.what or "memory" in a.what:   # memory alone: one step, no timing
        steps = a.time_steps if "time" in a.what else 0
        from parallel3d.testing import World
        print("| optimizer | world | s/step | optimizer MiB/rank |")
        print("|---|---|---|---|")
        for world in (1, 2):
            w = World(world, "gloo") if world > 1 else None
            for opt in ("adamw", "muon"):
                r = (w.run(step_time, (a.preset, opt, a.zero, steps), {}, 600)[0] if w
                     else step_time(None, a.preset, opt, a.zero, steps))
                print(f"| {opt} | {world} | {r['s']:.4f} | {r['optimizer_bytes'] / 2 ** 20:.2f} |", flush=True)
            if w:
                w.close()


if __name__ == "__main__":
    main()
