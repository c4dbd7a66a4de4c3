"""AdamW on a bucket's flat fp32 state: the update each rank applies to the segment it holds."""
from __future__ import annotations

import math
from typing import Optional

import torch

from parallel3d.data_parallel.buffer import Bucket


@torch.no_grad()
def adamw_(b: Bucket, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
           step: int, block: int = 1 << 16, grad: Optional[torch.Tensor] = None) -> None:
    """torch.optim.AdamW's single-tensor update on the bucket's flat fp32 state (padding stays 0).

    Weight decay is applied per parameter (views); the moment and parameter updates run over the flat
    segment in cache-sized blocks (the update is ~7 passes over 4 tensors: blocking keeps them in cache).
    """
    p, m, v = b.adam.master, b.adam.exp_avg, b.adam.exp_avg_sq
    grad = b.grad.shard if grad is None else grad  # offload: a host copy of the held gradient
    if weight_decay:
        for s in b.slots:
            if s.decay:
                s.flat(p).mul_(1 - lr * weight_decay)
    beta1, beta2 = betas
    step_size = lr / (1 - beta1 ** step)
    bc2_sqrt = math.sqrt(1 - beta2 ** step)
    for i in range(0, p.numel(), block):
        sl = slice(i, i + block)
        g = grad[sl] if grad.dtype == torch.float32 else grad[sl].float()
        mb, vb = m[sl], v[sl]
        mb.lerp_(g, 1 - beta1)
        vb.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = vb.sqrt().div_(bc2_sqrt).add_(eps)
        p[sl].addcdiv_(mb, denom, value=-step_size)


OFFLOAD_OPTIMIZER = ("none", "cpu")


def check_offload_optimizer(mode: str) -> None:
    """parallel.offload_optimizer: none, or cpu (master weights and Adam state in host memory, AdamW on the
    CPU). nvme is not built yet."""
    if mode == "nvme":
        raise ValueError("parallel.offload_optimizer=nvme is not implemented yet; use cpu or none")
    if mode not in OFFLOAD_OPTIMIZER:
        raise ValueError(f"parallel.offload_optimizer={mode!r} is not one of {', '.join(OFFLOAD_OPTIMIZER)}")
