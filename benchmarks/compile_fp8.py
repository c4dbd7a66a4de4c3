"""Training-step benchmarks of train.compile and train.fp8 through the real Trainer (tiny preset, CPU).

    python benchmarks/compile_fp8.py [--steps 20] [--fp8-steps 300]

compile: tokens/s of eager vs compiled blocks (train.compile=true, inductor), after 3 warm-up steps (the
compilation); fp8: mean loss of the last 20 of --fp8-steps steps of bf16, tensorwise and rowwise on the
demo text (global batch 8 x 32 tokens) and the relative gap to bf16. Never asserted (the tolerance test is
tests/test_fp8.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

import torch  # noqa: E402

TINY = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=172", "train.seq_len=128", "train.global_batch_size=8", "train.micro_batch_size=2",
        "parallel.tp=1", "train.precision=fp32", "train.warmup_steps=10", "train.lr=3e-3"]


def trainer(overrides):
    from launch.common import stage_builder
    from parallel3d.models.config import ModelConfig
    from parallel3d.mesh import ParallelContext
    from parallel3d.training.config import load_config
    from parallel3d.training.trainer import Trainer
    from parallel3d.training.validate import resolve_and_validate

    cfg = resolve_and_validate(load_config("configs/tiny.yaml", [*TINY, *overrides], ModelConfig), 1)
    return Trainer(cfg, ParallelContext.single(), stage_builder(cfg, ParallelContext.single())), cfg


def tokens_per_s(compile_blocks: bool, steps: int) -> float:
    tr, cfg = trainer([f"train.compile={str(compile_blocks).lower()}"])
    for _ in range(3):
        tr.train_step()
    t0 = time.perf_counter()
    for _ in range(steps):
        tr.train_step()
    return steps * cfg.train.global_batch_size * cfg.train.seq_len / (time.perf_counter() - t0)


def fp8_tail(recipe: str, steps: int) -> float:
    tr, _ = trainer(["train.precision=bf16", f"train.fp8={recipe}", "train.seq_len=32"])
    losses = [tr.train_step()["loss"] for _ in range(steps)]
    return sum(losses[-20:]) / 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--fp8-steps", type=int, default=300)
    ap.add_argument("--skip-compile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.skip_compile:
        eager, compiled = tokens_per_s(False, args.steps), tokens_per_s(True, args.steps)
        print(f"tiny preset fp32: eager {eager:.0f} tok/s, compiled blocks {compiled:.0f} tok/s, "
              f"ratio {compiled / eager:.2f}")
    ref = fp8_tail("none", args.fp8_steps)
    print(f"{'recipe':>10} {'loss (last 20)':>15} {'vs bf16':>8}")
    print(f"{'bf16':>10} {ref:>15.4f} {'':>8}")
    for recipe in ("tensorwise", "rowwise"):
        got = fp8_tail(recipe, args.fp8_steps)
        print(f"{recipe:>10} {got:>15.4f} {(got - ref) / ref:>+8.2%}")


if __name__ == "__main__":
    main()
