"""Mixed precision: compute dtypes and the fp16 dynamic loss scaler.

    precision   model params (compute)   gradient accumulation   master weights + Adam m, v
    fp32        fp32                     fp32                    fp32 (the params themselves w/o ZeRO)
    bf16        bf16                     fp32 (main grads)       fp32
    fp16        fp16                     fp32, loss-scaled       fp32, dynamic loss scale

fp16 has too little range for small gradients, so the loss is multiplied by a scale S before backward
and the gradients divided by S before the update. If any rank sees inf/nan, every rank skips the step
(the flag is all-reduced over the world together with the gradient norm) and S halves; after `window`
clean steps S doubles. A positive `loss_scale` fixes S (static scaling, still skipping overflows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(precision: str) -> torch.dtype:
    if precision not in DTYPES:
        raise ValueError(f"train.precision must be one of {sorted(DTYPES)}, got {precision!r}")
    return DTYPES[precision]


@dataclass
class LossScaler:
    """Dynamic (or static, if `static`) loss scale for fp16."""
    scale: float = 2.0 ** 16
    window: int = 1000
    min_scale: float = 1.0
    static: bool = False
    good_steps: int = 0
    overflows: int = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.overflows += 1
            self.good_steps = 0
            if not self.static:
                self.scale = max(self.scale / 2.0, self.min_scale)
            return
        self.good_steps += 1
        if not self.static and self.good_steps >= self.window:
            self.scale *= 2.0
            self.good_steps = 0

    def state(self) -> dict:
        return {"loss_scale": self.scale, "good_steps": self.good_steps, "overflows": self.overflows}

    def load(self, d: dict) -> None:
        self.scale = float(d.get("loss_scale", self.scale))
        self.good_steps = int(d.get("good_steps", 0))
        self.overflows = int(d.get("overflows", 0))
