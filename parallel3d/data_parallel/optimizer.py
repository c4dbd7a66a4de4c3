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

Buckets and their layouts (contiguous ranges for ZeRO 0-2, rank-major rows for ZeRO-3): buffer.py, build.py. Gradient hooks and each bucket's
reduction (HSDP, compression, qgZ): sync.py. Parameters from the updated master: publishing.py.
Norm and clipping: clip.py; AdamW: adamw.py. Checkpoint state, gradient views and memory accounting:
state.py. The optimizer only assumes its `modules` list (the model chunks on this rank): it works under
any TP/PP/CP/EP layout whose parameters carry `meta`. Construct it after the weights are final
(initialised or loaded): it copies them into its master weights (and under ZeRO-3 frees the unsharded
parameters); later loads go through `load_state_tensors`.
"""
from __future__ import annotations

import collections
from typing import Callable, Optional

import torch
from torch import nn

from parallel3d.data_parallel.state import OptimizerState
from parallel3d.data_parallel.buffer import Bucket
from parallel3d.data_parallel.build import bucket_elems, init_bucket, local_ties, plan
from parallel3d.data_parallel.adamw import adamw_, check_offload
from parallel3d.data_parallel.clip import clip_, grad_stats
from parallel3d.data_parallel.compression import Compressor, check_compression
from parallel3d import comm
from parallel3d.data_parallel.precision import LossScaler, compute_dtype
from parallel3d.data_parallel.quantize import check_zeropp
from parallel3d.data_parallel.publishing import ParamPublishing
from parallel3d.data_parallel.fp8_gather import check_fp8_gather, fp8_slots
from parallel3d.data_parallel.sync import BucketReduction, FollowUps, Pending
from parallel3d.data_parallel.zero3 import Zero3, ZeroPP
from parallel3d.mesh import ParallelContext, check_hpz


class DistributedOptimizer(BucketReduction, ParamPublishing, OptimizerState):
    """See the module docstring. `grad_dtype` (extra, default fp32) is the dtype of the gradient buffers
    and reductions; set it to the model dtype to trade accuracy for memory (the ZeRO paper's 2-byte grads).
    Bucket size: build.bucket_elems (bucket_size_mb > 0 overrides bucket_size; both unset: max(40M, 1M x dp))."""

    def __init__(self, modules: list[nn.Module], ctx: ParallelContext, *, zero: int = 0, precision: str = "fp32",
                 lr: float = 3e-4, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 bucket_size: int = 0, bucket_size_mb: float = 0.0,
                 no_decay: Optional[Callable[[str, nn.Parameter], bool]] = None,
                 loss_scale: float = 0.0, initial_loss_scale: float = 2 ** 16, loss_scale_window: int = 1000,
                 min_loss_scale: float = 1.0, grad_dtype: Optional[torch.dtype] = None,
                 offload_optimizer: str = "none", offload_params: str = "none", offload_dir: Optional[str] = None,
                 offload_buffer_mb: float = 64.0, grad_compression: str = "none", powersgd_rank: int = 4,
                 topk_ratio: float = 0.01, compression_start_step: int = 0, quantized_weights: bool = False,
                 hpz: bool = False, quantized_gradients: bool = False, quant_block: int = 256,
                 fp8_gather: bool = False, overlap_param_gather: bool = False) -> None:
        if zero not in (0, 1, 2, 3):
            raise ValueError(f"parallel.zero must be 0, 1, 2 or 3, got {zero!r}")
        check_offload(offload_optimizer, offload_params, zero, offload_dir, offload_buffer_mb)
        check_compression(grad_compression, zero, powersgd_rank, topk_ratio, compression_start_step,
                          ctx.spec.hsdp, precision, ctx.dp_cp.size)
        check_zeropp(zero, quantized_weights, hpz, quantized_gradients, quant_block)
        if hpz:
            check_hpz(ctx.spec)
        # qgZ: the ZeRO-3 gradient reduce-scatter travels as int8 blocks (quantize.py); 0 = exact
        self.qgz_block = quant_block if quantized_gradients else 0
        if ctx.device.type == "meta" and (offload_optimizer, offload_params) != ("none", "none"):
            raise ValueError("offload needs host memory, which the meta-device stand-in has no values for: the "
                             "planner dry-runs the device step without it (parallel3d/planner/offload.py)")
        # offload: fp32 master and Adam state in host memory (cpu) or files (nvme); AdamW runs on the CPU
        self.state_device = torch.device("cpu") if offload_optimizer != "none" else None
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.ctx, self.zero, self.precision = ctx, zero, precision
        self.dtype = compute_dtype(precision)
        self.grad_dtype = grad_dtype or torch.float32
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.scaler: Optional[LossScaler] = None
        if precision == "fp16":
            self.scaler = LossScaler(loss_scale if loss_scale > 0 else initial_loss_scale, loss_scale_window,
                                     min_loss_scale, static=loss_scale > 0)
        self.step_count = 0
        self._synced, self._prepared, self._clipped = False, False, False
        self._norm, self._found_inf = 0.0, False
        self._inflight: collections.deque[Pending] = collections.deque()
        self.zero3: Optional[Zero3] = None
        no_decay = no_decay or (lambda name, p: p.dim() == 1)
        self.bucket_elems = bucket_elems(ctx.dp_cp.size, bucket_size, bucket_size_mb,
                                         torch.finfo(self.grad_dtype).bits // 8)
        self.seqs, chains = plan(self.modules, ctx, zero, no_decay, self.bucket_elems)
        self.buckets = [b for bs in self.seqs for b in bs]
        if fp8_gather:  # the recipe of the fp8 linears (convert_to_fp8 tags their weights); "none": there are none
            recipe = next((s.param.fp8.recipe for b in self.buckets for s in fp8_slots(b)), "none")
            check_fp8_gather(fp8_gather, zero, recipe, quantized_weights, hpz, "none")
        self._next = [0] * len(self.seqs)    # per sequence: the next bucket to launch
        self.params = [s.param for b in self.buckets for s in b.slots]
        self.nvme = self.param_home = None   # offload homes (parallel3d/offload): NVMe Adam state, parameters
        # offload: host <-> device copies beside compute (offload/streams.py); gradients leave per bucket
        # as reduced (offload/host_grads.py), parameters come back per bucket (offload/publish.py)
        self.copies = self.host_grads = self.published = None
        self._clip_coef: Optional[float] = None
        if (offload_optimizer, offload_params) != ("none", "none"):
            from parallel3d.offload.publish import DevicePublish
            from parallel3d.offload.streams import CopyEngine
            self.copies = CopyEngine(ctx.device)
            self.published = DevicePublish(self.copies)
        if offload_optimizer != "none":       # reduced gradients leave the device per bucket (host_grads.py)
            from parallel3d.offload.host_grads import HostGrads
            self.host_grads = HostGrads(self.copies)
        # ZeRO-2/3 and offload reduce every bucket in every backward and free its buffer (sync.py)
        self.per_microbatch = zero >= 2 or self.host_grads is not None
        if offload_optimizer == "nvme":       # before init_bucket: ZeRO-3 frees the parameters it reads
            from parallel3d.offload.nvme import NvmeAdam
            self.nvme = NvmeAdam.create(self.buckets, ctx, offload_dir, offload_buffer_mb, self.copies)
        for b in self.buckets:
            init_bucket(b, zero, self.dtype, self.grad_dtype, self.state_device, resident=self.nvme is None)
            b.adam.home = self.nvme
            if self.per_microbatch:           # no persistent device gradient buffer (ZeRO-0/1 under offload)
                b.grad.full = b.grad.shard = None
        self.follow = FollowUps(any(comm.orders_on_device(b.group) for b in self.buckets), ctx.device)
        if zero == 3:
            gather = {e: ctx.clone("edp_shard" if e else "dp_shard") for e in (False, True)}
            node = {e: ctx.clone("edp_node" if e else "dp_node") for e in (False, True)} if hpz else None
            self.zero3 = Zero3(chains, gather, self.dtype, ZeroPP(quant_block if quantized_weights else 0, node,
                                                                  fp8_gather))

        if offload_params != "none":          # takes each bucket's param_flat off the device
            from parallel3d.offload.params import ParamOffload
            self.param_home = ParamOffload.create(self.buckets, offload_params, self.dtype, ctx, offload_dir,
                                                  self.copies)
            self.zero3.fetch = self.param_home.fetch
        elif zero == 3 and self.published is not None:   # the shard may still be on its way from the step
            self.zero3.fetch = self._published_shard
        self._chains = chains
        self.compressor = Compressor(grad_compression, self.buckets, powersgd_rank, topk_ratio,
                                     compression_start_step) if grad_compression != "none" else None
        self._last = [True] * len(self.modules)  # per chunk: is the running backward the step's last one?
        self._chunk_seqs: dict[int, list[int]] = {}
        for i, bs in enumerate(self.seqs):
            self._chunk_seqs.setdefault(bs[0].chunk, []).append(i)
        self._touched: set[int] = set()      # chunks whose gradients arrived during the running backward
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._grad_hook(b, s))
                       for b in self.buckets for s in b.slots]
        if zero == 0 and self.published is not None:   # a module's forward waits for its own buckets only
            self._hooks += self.published.hooks(self.buckets, self.modules)
        self._local_ties = local_ties(self.buckets)
        self._init_publishing(overlap_param_gather)   # ZeRO-1/2 gathers waited by the next forward

    # ---- trainer API --------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        self._follow_ups(block=True)      # reductions a step never waited for (an abandoned step)
        self.follow.join()
        if self.host_grads is not None:   # copies of a skipped step may still read the buffers zeroed here
            self.host_grads.reset(self.buckets)
        self._clip_coef = None
        for b in self.buckets:
            b.grad.count, b.grad.ready, b.grad.launched, b.grad.work, b.grad.out = 0, False, False, None, None
            b.grad.replicating = False
            if not self.per_microbatch:
                b.grad.full.zero_()
                b.grad.shard = b.grad.full if self.zero == 0 else None
            else:
                b.grad.full = b.grad.shard = None
        for p in self.params:
            p.grad = None
        self._touched.clear()
        self._next = [0] * len(self.seqs)
        self._synced = self._prepared = self._clipped = False

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scaler.scale if self.scaler is not None else loss

    def set_last_microbatch(self, last: bool, chunk: Optional[int] = None) -> None:
        """Mark whether the next backward is the step's last for every chunk, or only for `chunk` (index
        into `modules`: interleaved pipeline schedules finish the chunks' microbatches at different times)."""
        for i in range(len(self._last)) if chunk is None else [chunk]:
            self._last[i] = bool(last)

    @torch.no_grad()
    def finish_grad_sync(self) -> None:
        if self._synced:
            return
        self.wait_params()   # overlap_param_gather: buckets no forward used
        for seq, bs in enumerate(self.seqs):        # unused parameters: launch what never became ready
            for b in bs[self._next[seq]:]:
                b.grad.ready = True
            self._launch_ready(seq)
        self._drain_reductions()
        self._reduce_extra_groups()
        if self.published is not None:    # backstop: every parameter copy of the last step has landed
            self.published.wait_all()
        if self.zero3 is not None:
            self.zero3.free_all()
        self._synced = True

    def _prepare(self) -> None:
        if self._prepared:
            return
        self.finish_grad_sync()
        inv = 1.0 / self.scaler.scale if self.scaler is not None else 1.0
        self._norm, self._found_inf = grad_stats(self.buckets, self.ctx, self.zero, inv)
        self._prepared = True

    def clip_grad_norm(self, max_norm: float) -> float:
        """Exact global L2 norm of the unscaled gradients (nan/inf on overflow); clips once if max_norm > 0.
        Collective over the world: every rank (every pipeline stage) must call it."""
        self._prepare()
        if max_norm > 0 and not self._found_inf and not self._clipped:
            self._clip_coef = clip_(self.buckets, self._norm, max_norm)
            self._clipped = True
        return self._norm

    @torch.no_grad()
    def step(self, lr: Optional[float] = None) -> bool:
        """AdamW on the held shard, then refresh the parameters. Collective over the world (the skip
        decision is shared); lr=None uses the constructor's lr."""
        lr = self.lr if lr is None else lr
        self._prepare()
        found = self._found_inf
        if self.scaler is not None:
            self.scaler.update(found)
        self._prepared = False
        if found:
            if self.host_grads is not None:
                self.host_grads.drain(self.buckets)
            return False
        self.step_count += 1
        # offload: forward order (buckets are in backward order), so the first layers' parameters are
        # back on the device first and the next forward can start on them (offload/publish.py)
        order = self.buckets if self.copies is None else self.buckets[::-1]
        if self.nvme is not None:  # streamed: each updated master chunk is published as it is produced
            self.nvme.step(order, lr, self.betas, self.eps, self.weight_decay, self.step_count,
                           self.publish_chunk)
            self.publish_params(streamed=True)
            return True
        pending = []
        for b in order:   # offload: b.grad.shard is the host gradient (offload/host_grads.py)
            adamw_(b, lr, self.betas, self.eps, self.weight_decay, self.step_count)
            if self.zero in (1, 2):   # the bucket's all-gather travels while the next buckets update
                started = self._start_publish(b)
                if self.overlap_param_gather:   # ... and beside the next forward, which waits for it
                    self._gathers[id(b)] = started
                else:
                    pending.append(started)
            elif self.published is not None and b.param_flat is not b.adam.master:
                self.publish_chunk(b, 0, b.seg, b.adam.master)   # its copy travels while the next update
        if self.zero in (1, 2):
            self._finish_publish(pending)
        elif self.published is None:
            self.publish_params()
        elif self.zero3 is not None:
            self.zero3.invalidate()
        return True

    def skip_step(self) -> bool:
        """The trainer skips this step (non-finite loss or gradients): no update, but an fp16 dynamic
        scaler still sees the overflow and backs off, so later steps can succeed. Returns False."""
        self._prepare()
        if self.scaler is not None:
            self.scaler.update(True)
        self._prepared = False
        if self.host_grads is not None:
            self.host_grads.drain(self.buckets)
        return False

    @property
    def overflowed(self) -> bool:
        """The prepared gradients hold inf/nan (after clip_grad_norm or step preparation)."""
        return self._found_inf

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0

    @property
    def grad_norm(self) -> float:
        return self._norm

    def close(self) -> None:
        """Remove the offload files (also done at exit)."""
        self.wait_params()
        if self.published is not None:
            self.published.wait_all()
        if self.host_grads is not None:
            self.host_grads.drain(self.buckets)
        for home in (self.nvme, self.param_home, self.copies, self.host_grads):
            if home is not None:
                home.close()

    def remove_hooks(self) -> None:
        """Detach from the model (gradient hooks, ZeRO-3 forward hooks)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.zero3 is not None:
            self.zero3.remove()
