"""Learning-rate schedule: linear warmup, then cosine (or linear) decay to `min_lr`.

A pure function of the optimizer step, so a resumed run needs only the step number to continue on the
same curve, and every rank computes the same value without communication.
"""
from __future__ import annotations

import math
from typing import Any

LR_SCHEDULES = ("cosine", "linear", "constant")  # train.lr_schedule


def lr_at(step: int, cfg: Any) -> float:
    """Learning rate for 0-based optimizer step `step` under a `TrainConfig`-like `cfg`.

    Reads `lr`, `min_lr`, `warmup_steps`, `steps`, and optionally `lr_decay_steps` (0: `steps`) and
    `lr_schedule` (cosine | linear | constant; default cosine).

    - warmup: steps 0 .. warmup_steps-1 ramp linearly, lr * (step+1) / warmup_steps, so the first
      update is already non-zero and step warmup_steps-1 reaches the peak `lr`;
    - decay: from step warmup_steps (peak) to step lr_decay_steps (exactly `min_lr`), then flat.
    """
    peak, floor = float(cfg.lr), float(cfg.min_lr)
    warmup = int(cfg.warmup_steps)
    kind = cfg.lr_schedule
    total = int(cfg.lr_decay_steps or cfg.steps)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup:
        return peak * (step + 1) / warmup
    if kind == "constant":
        return peak
    span = total - warmup
    progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
    if kind == "cosine":
        return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * progress))
    if kind == "linear":
        return peak + (floor - peak) * progress
    raise ValueError(f"unknown lr_schedule {kind!r} (one of {', '.join(LR_SCHEDULES)})")
