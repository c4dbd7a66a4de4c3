"""DistributedOptimizer: bucketed, overlapped gradient reduction + AdamW with ZeRO-0/1/2/3 and mixed precision.

Trainer protocol, per optimizer step:

    opt.zero_grad()
    for i, mb in enumerate(microbatches):
        opt.set_last_microbatch(i == len(microbatches) - 1)   # ZeRO-0/1 reduce on the last one only
        opt.scale_loss(model(mb) / global_target_tokens).backward()
    opt.finish_grad_sync()          # wait for every bucket; grad_reduce groups (tp, embedding)
    norm = opt.clip_grad_norm(1.0)  # exact global norm (unscaled); clips if max_norm > 0
    ok = opt.step(lr)               # False (on every rank) if some gradient is inf/nan

Gradients are summed over DP x CP (dense) or expert-DP (meta.expert), never averaged: the loss is
already normalised by the global token count (docs/architecture.md section 2.2; `grads.reduce_gradients` is the reference).

    zero  gradient reduction per bucket       after reduction keeps   optimizer state    params
    0     all-reduce                          full buffer             full (every rank)   full
    1     reduce-scatter, all-gather params   full buffer             1/N                 full
    2     reduce-scatter, all-gather params   1/N (full one freed)    1/N                 full
    3     reduce-scatter; params gathered     1/N                     1/N                 1/N
          around each unit's fwd and bwd (zero3.py)

Construction: `DistributedOptimizer(modules, ctx, config, zero3=None)`, config a DataParallelConfig
(config.py; `DataParallelConfig.from_train_config(cfg)` from a training config), zero3 ZeRO-3's gatherer,
attached to the chunks first (attach.py; `attach(modules, ctx, config)` does both). It replaced ~30
keyword arguments. The optimizer wires one owner per job, each receiving what it works with:

    buckets           build.py (layouts: buffer.py); ZeRO-3: the gatherer's unit buckets
    GradientSync      sync.py: hooks, bucket reductions (HSDP, compression, qgZ), grad_reduce sums
    OptimizerStep     step.py: loss scaler, norm and clipping (clip.py), AdamW (adamw.py), step count
    ParamPublisher    publishing.py: updated master -> parameters (ZeRO-1/2 gathers, overlap)
    Zero3             zero3.py: parameters gathered around each unit's use (a model wrapper, attach.py)
    OffloadHomes      offload/homes.py: host/NVMe homes of the state, the copies that move it
    checkpoint state  state.py: state tensors, gradient views, memory accounting

and keeps the Trainer protocol above. It only assumes its `modules` list (the model chunks on this
rank): it works under any TP/PP/CP/EP layout whose parameters carry `meta`. Construct it after the
weights are final (initialised or loaded): it copies them into its master weights (and under ZeRO-3
frees the unsharded parameters); later loads go through `load_state_tensors`.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from parallel3d.data_parallel.build import bucket_elems, init_bucket, plan
from parallel3d.data_parallel.compression import Compressor
from parallel3d.data_parallel.config import DataParallelConfig
from parallel3d.data_parallel.precision import LossScaler, compute_dtype
from parallel3d.data_parallel.publishing import ParamPublisher
from parallel3d.data_parallel.state import (KINDS, grad_slices, load_state_tensors, memory_bytes, state_by_category,
                                            state_tensors)
from parallel3d.data_parallel.step import OptimizerStep
from parallel3d.data_parallel.sync import GradientSync
from parallel3d.data_parallel.zero3 import Zero3
from parallel3d.mesh import ParallelContext
from parallel3d.offload.homes import OffloadHomes


class DistributedOptimizer:
    """See the module docstring. `config` holds every option (config.py); `zero3` is required exactly
    when config.zero == 3 (attach.attach_zero3)."""

    def __init__(self, modules: list[nn.Module], ctx: ParallelContext, config: DataParallelConfig,
                 zero3: Optional[Zero3] = None) -> None:
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        config.check(ctx, self.modules)
        if (config.zero == 3) != (zero3 is not None):
            raise ValueError(f"parallel.zero={config.zero}: ZeRO-3 needs its parameter gathering attached to the "
                             f"chunks first and passed as zero3 (attach.attach_zero3), the other stages none; "
                             f"data_parallel.attach(modules, ctx, config) does both")
        self.config, self.ctx, self.zero, self.zero3 = config, ctx, config.zero, zero3
        self.dtype = compute_dtype(config.precision)
        self.grad_dtype = config.grad_dtype or torch.float32
        if zero3 is None:
            elems = bucket_elems(ctx.dp_cp.size, config.bucket_size, config.bucket_size_mb,
                                 torch.finfo(self.grad_dtype).bits // 8)
            seqs, _ = plan(self.modules, ctx, self.zero, config.decay_filter, elems)
        else:
            seqs = zero3.seqs
        self.buckets = [b for bs in seqs for b in bs]
        self.params = [s.param for b in self.buckets for s in b.slots]
        self.homes = OffloadHomes(config.offload_optimizer, config.offload_params, config.offload_dir,
                                  config.offload_buffer_mb, ctx)
        # ZeRO-2/3 and offload reduce every bucket in every backward and free its buffer (sync.py)
        self.per_microbatch = self.zero >= 2 or self.homes.host_grads is not None
        self.homes.place_state(self.buckets)   # before init_bucket: ZeRO-3 frees the parameters it reads
        for b in self.buckets:
            init_bucket(b, self.zero, self.dtype, self.grad_dtype, self.homes.state_device,
                        resident=self.homes.nvme is None)
            b.adam.home = self.homes.nvme
            if self.per_microbatch:           # no persistent device gradient buffer (ZeRO-0/1 under offload)
                b.grad.full = b.grad.shard = None
        self.homes.place_params(self.buckets, self.dtype)   # takes each bucket's param_flat off the device
        c = config
        self.compressor = Compressor(c.grad_compression, self.buckets, c.powersgd_rank, c.topk_ratio,
                                     c.compression_start_step) if c.grad_compression != "none" else None
        self.grads = GradientSync(seqs, len(self.modules), ctx, self.zero, self.grad_dtype, self.per_microbatch,
                                  self.compressor, c.quant_block if c.quantized_gradients else 0,
                                  self.homes.host_grads, zero3)
        # overlap_param_gather: the gathers stay in flight into the next step, so they run on clones of the
        # shard groups; on NCCL a group's collectives run in issue order, and the next step's token count,
        # loss and MoE telemetry on DP x CP would otherwise wait behind every gather (and the host with them)
        gather_groups = ({e: ctx.clone("edp_shard" if e else "dp_shard") for e in (False, True)}
                         if c.overlap_param_gather and self.zero in (1, 2) else None)
        self.publisher = ParamPublisher(self.buckets, self.modules, self.zero, self.dtype, self.homes, zero3,
                                        c.overlap_param_gather, gather_groups)
        self.stepper = OptimizerStep(self.buckets, ctx, config, self.publisher, self.homes)
        self.scaler: Optional[LossScaler] = self.stepper.scaler
        self._synced = False

    # ---- trainer API --------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self.grads.zero_grad(self.stepper.step_count)
        self.stepper.reset()
        self._synced = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.stepper.scale_loss(loss)

    def set_last_microbatch(self, last: bool, chunk: Optional[int] = None) -> None:
        """Mark whether the next backward is the step's last for every chunk, or only for `chunk` (index
        into `modules`: interleaved pipeline schedules finish the chunks' microbatches at different times)."""
        self.grads.set_last_microbatch(last, chunk)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        if self._synced:
            return
        self.publisher.wait_params()   # overlap_param_gather: buckets no forward used
        self.grads.finish()
        self.homes.wait_published()    # backstop: every parameter copy of the last step has landed
        if self.zero3 is not None:
            self.zero3.free_all()
        self._synced = True

    def _prepare(self) -> None:
        if not self.stepper.prepared:
            self.finish_grad_sync()
            self.stepper.prepare()

    def clip_grad_norm(self, max_norm: float) -> float:
        """Exact global L2 norm of the unscaled gradients (nan/inf on overflow); clips once if max_norm > 0.
        Collective over the world: every rank (every pipeline stage) must call it."""
        self._prepare()
        return self.stepper.clip(max_norm)

    def step(self, lr: Optional[float] = None) -> bool:
        """AdamW on the held shard, then refresh the parameters. Collective over the world (the skip
        decision is shared); lr=None uses the config's lr. False (on every rank) on inf/nan gradients."""
        self._prepare()
        return self.stepper.step(lr)

    def skip_step(self) -> bool:
        """The trainer skips this step (non-finite loss or gradients): no update, but an fp16 dynamic
        scaler still sees the overflow and backs off, so later steps can succeed. Returns False."""
        self._prepare()
        return self.stepper.skip()

    @property
    def step_count(self) -> int:
        return self.stepper.step_count

    @property
    def overflowed(self) -> bool:
        """The prepared gradients hold inf/nan (after clip_grad_norm or step preparation)."""
        return self.stepper.found_inf

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def grad_norm(self) -> float:
        return self.stepper.norm

    def wait_params(self) -> None:
        """Every parameter up to date (overlap_param_gather: the gathers no forward has waited for yet).
        Call before reading parameters outside the model's forward (checkpoints, tests)."""
        self.publisher.wait_params()

    def publish_params(self) -> None:
        """Copy the fp32 master weights into the model parameters (all-gathered for ZeRO-1/2)."""
        self.publisher.publish_params()

    def close(self) -> None:
        """Remove the offload files (also done at exit)."""
        self.publisher.wait_params()
        self.homes.close(self.buckets)

    def remove_hooks(self) -> None:
        """Detach from the model (gradient hooks, publishing hooks, ZeRO-3 forward hooks)."""
        self.grads.remove()
        self.publisher.remove()
        if self.zero3 is not None:
            self.zero3.remove()

    # ---- checkpoint state (checkpoint.protocol.OptimizerState) and accounting (state.py) --------------
    def scalar_state(self) -> dict:
        return self.stepper.scalar_state()

    def load_scalar_state(self, d: dict) -> None:
        self.stepper.load_scalar_state(d)

    def state_tensors(self) -> dict[str, tuple[torch.Tensor, tuple, tuple[slice, ...]]]:
        self.homes.wait_published()   # a checkpoint also reads the parameters
        self.publisher.wait_params()
        return state_tensors(self.buckets, self.ctx, self.zero)

    def load_state_tensors(self, read: Callable[[str, tuple[slice, ...]], torch.Tensor],
                           kinds: tuple[str, ...] = KINDS) -> None:
        load_state_tensors(self.buckets, read, kinds)
        if "master" in kinds:
            self.publisher.publish_params()

    def local_state_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's own state (not a slice of a global tensor): gradient-compression residuals and
        PowerSGD's Q. Checkpoints keep it per rank and restore it under the same layout."""
        return self.compressor.local_state() if self.compressor is not None else {}

    def load_local_state_tensors(self, d: dict[str, torch.Tensor]) -> None:
        if self.compressor is not None:
            self.compressor.load_local_state(d)

    def grad_slices(self) -> dict[str, tuple[torch.Tensor, tuple[slice, ...], tuple]]:
        """The reduced gradients this rank holds, unscaled (state.grad_slices)."""
        self.finish_grad_sync()
        return grad_slices(self.buckets, 1.0 if self.stepper.prepared else self.stepper.inv_scale)

    def memory_bytes(self) -> dict[str, int]:
        return memory_bytes(self.buckets, self.params)

    def state_by_category(self) -> dict[str, list[torch.Tensor]]:
        """Model-state tensors per category (params, grads, optimizer); see state.state_by_category."""
        return state_by_category(self.buckets, self.params)
