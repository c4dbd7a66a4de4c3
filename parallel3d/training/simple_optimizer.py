"""A minimal optimizer with DistributedOptimizer's interface: zero=0, fp32, synchronous reduction.

Used only until parallel3d.data_parallel provides DistributedOptimizer (then deleted)."""
from __future__ import annotations

import math

import torch

from parallel3d import comm
from parallel3d.data_parallel.grads import reduce_gradients
from parallel3d.mesh import ParallelContext


def owns_replica(p: torch.nn.Parameter, ctx: ParallelContext) -> bool:
    """True on exactly one rank among those holding identical copies of p's (reduced) gradient."""
    groups = [ctx.edp if p.meta.expert else ctx.dp_cp] + [getattr(ctx, g) for g in p.meta.replicated]
    return all(g is None or g.rank == 0 for g in groups)


class SimpleOptimizer:
    def __init__(self, modules, ctx: ParallelContext, *, zero: int = 0, precision: str = "fp32", lr: float = 3e-4,
                 betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1, **_ignored) -> None:
        if zero or precision != "fp32":
            raise NotImplementedError("SimpleOptimizer supports zero=0 and fp32 only")
        self.ctx = ctx
        self.params = [p for m in modules for p in m.parameters()]
        decay = [p for p in self.params if p.dim() > 1]
        no_decay = [p for p in self.params if p.dim() <= 1]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas, eps=eps)

    loss_scale = 1.0

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def set_last_microbatch(self, last: bool) -> None:
        pass

    def finish_grad_sync(self) -> None:
        reduce_gradients(self.params, self.ctx)

    def clip_grad_norm(self, max_norm: float) -> float:
        sq = torch.zeros(1)
        for p in self.params:
            if owns_replica(p, self.ctx):
                sq += p.grad.float().pow(2).sum().cpu()
        comm.all_reduce(sq, self.ctx.world)
        norm = math.sqrt(sq.item())
        if max_norm > 0 and norm > max_norm:
            for p in self.params:
                p.grad.mul_(max_norm / (norm + 1e-6))
        return norm

    def step(self, lr: float) -> bool:
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.opt.step()
        return True
