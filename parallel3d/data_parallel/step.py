"""The optimizer step: loss scaling, the exact global gradient norm, clipping and AdamW on the held shards.

`OptimizerStep` owns the fp16 loss scaler, the step count, the learning-rate hyperparameters and the
state of one step's prepared gradients (their unscaled global norm and the overflow flag, clip.py's
`grad_stats`, computed once per step after the gradient sync), clipping (clip.py) and the update: AdamW
(adamw.py) bucket after bucket on the held gradient shards, or streamed through the files under NVMe
offload (offload/nvme.py); with train.optimizer=muon first Muon on the matrix slots of every bucket
(muon_step.py: its exchanges cross the buckets), then AdamW on the other slots' ranges. It hands each
updated bucket to the parameter publisher (publishing.py), so
the parameters travel while the next buckets update. It receives the buckets, the publisher and the
offload homes; the DistributedOptimizer finishes the gradient sync before `prepare`.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from parallel3d.data_parallel.adamw import adamw_
from parallel3d.data_parallel.buffer import Bucket
from parallel3d.data_parallel.clip import clip_, grad_stats
from parallel3d.data_parallel.config import DataParallelConfig
from parallel3d.data_parallel.muon_step import MuonStep
from parallel3d.data_parallel.precision import LossScaler
from parallel3d.data_parallel.publishing import ParamPublisher
from parallel3d.mesh import ParallelContext
from parallel3d.offload.homes import OffloadHomes


class OptimizerStep:
    def __init__(self, buckets: Sequence[Bucket], ctx: ParallelContext, config: DataParallelConfig,
                 publisher: ParamPublisher, homes: OffloadHomes) -> None:
        self.buckets, self.ctx, self.zero = list(buckets), ctx, config.zero
        self.publisher, self.homes = publisher, homes
        # the update order: forward order (buckets are in backward order) where the next forward may start
        # before the step's publishing is done: offload's device copies (offload/publish.py) and
        # overlap_param_gather's gathers, which are then issued in the order the forward waits for them (on
        # NCCL a group's collectives complete in issue order: gathers issued last layers first would hold the
        # first block)
        ahead = homes.copies is not None or publisher.overlap_param_gather
        self.order = forward_order(self.buckets) if ahead else self.buckets
        self.lr, self.betas, self.eps, self.weight_decay = config.lr, config.betas, config.eps, config.weight_decay
        self.block = config.adamw_block or None   # None: by device (adamw.block_for)
        # train.optimizer=muon: Muon for the matrix slots (muon_step.py), AdamW for the rest
        self.muon = MuonStep(self.buckets, ctx, config) if config.optimizer == "muon" else None
        self.scaler: Optional[LossScaler] = None
        if config.precision == "fp16":
            c = config
            self.scaler = LossScaler(c.loss_scale if c.loss_scale > 0 else c.initial_loss_scale, c.loss_scale_window,
                                     c.min_loss_scale, static=c.loss_scale > 0)
        self.step_count = 0
        self.prepared = self.clipped = False
        self.norm, self.found_inf = 0.0, False

    def reset(self) -> None:
        """A new step's gradients are coming (zero_grad)."""
        self.prepared = self.clipped = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    @property
    def inv_scale(self) -> float:
        return 1.0 / self.scaler.scale if self.scaler is not None else 1.0

    def prepare(self) -> None:
        """The synced gradients' exact global norm (unscaled) and overflow flag, once per step."""
        if self.prepared:
            return
        self.norm, self.found_inf = grad_stats(self.buckets, self.ctx, self.zero, self.inv_scale)
        self.prepared = True

    def clip(self, max_norm: float) -> float:
        self.prepare()
        if max_norm > 0 and not self.found_inf and not self.clipped:
            clip_(self.buckets, self.norm, max_norm)
            self.clipped = True
        return self.norm

    @torch.no_grad()
    def step(self, lr: Optional[float] = None) -> bool:
        lr = self.lr if lr is None else lr
        self.prepare()
        found = self.found_inf
        if self.scaler is not None:
            self.scaler.update(found)
        self.prepared = False
        if found:
            self.homes.drain(self.buckets)
            return False
        self.step_count += 1
        order = self.order
        if self.homes.nvme is not None:  # streamed: each updated master chunk is published as it is produced
            self.homes.nvme.step(order, lr, self.betas, self.eps, self.weight_decay, self.step_count,
                                 self.publisher.publish_chunk)
            self.publisher.publish_params(streamed=True)
            return True
        if self.muon is not None:   # every matrix's update lands in the masters before any bucket publishes
            self.muon.step(lr)
        for b in order:   # offload: b.grad.shard is the host gradient (offload/host_grads.py)
            ranges = self.muon.adamw_ranges(b) if self.muon is not None else None
            adamw_(b, lr, self.betas, self.eps, self.weight_decay, self.step_count, block=self.block, ranges=ranges)
            self.publisher.updated(b)
        self.publisher.step_done()
        return True

    def skip(self) -> bool:
        self.prepare()
        if self.scaler is not None:
            self.scaler.update(True)
        self.prepared = False
        self.homes.drain(self.buckets)
        return False

    def scalar_state(self) -> dict:
        out = {"step": self.step_count}
        if self.scaler is not None:
            out.update(self.scaler.state())
        return out

    def load_scalar_state(self, d: dict) -> None:
        self.step_count = int(d.get("step", 0))
        if self.scaler is not None:
            self.scaler.load(d)


def forward_order(buckets: Sequence[Bucket]) -> list[Bucket]:
    """The order in which the next forward reads the buckets: chunk by chunk, and within a chunk against the
    launch order of its sequences (buckets pack parameters in reverse registration order, build.py)."""
    return [b for _, b in sorted(enumerate(buckets), key=lambda ib: (ib[1].chunk, -ib[0]))]
