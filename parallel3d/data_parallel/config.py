"""DataParallelConfig: every option of data parallelism and the optimizer, in one typed, frozen value.

The DistributedOptimizer (optimizer.py), ZeRO-3's parameter gathering (attach.py) and the owners they
build (gradient sync, optimizer step, parameter publishing, offload homes) read their options from here.
`from_train_config` is the one mapping from the training configuration (parallel.*, train.*); a run
that does not come from a training config builds the dataclass directly (tests, benchmarks).

Validation calls each rule's owner, never restating it:
    on construction     parallel.zero's range, check_offload and check_block (adamw.py), check_zeropp (quantize.py),
                        check_muon (muon.py)
    check(ctx, modules) what needs the layout or the model (the optimizer calls it before anything
                        collective): check_offload_device (adamw.py), check_compression (compression.py),
                        check_hpz (mesh_spec.py), check_fp8_gather (fp8_gather.py, with the model's recipe),
                        check_muon_model (muon.py: the model has hidden matrices, each splits into matrices)
The training path validates the same keys earlier, by the same owners (training/validate.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from parallel3d.data_parallel.adamw import check_block, check_offload, check_offload_device
from parallel3d.data_parallel.compression import check_compression
from parallel3d.data_parallel.fp8_gather import check_fp8_gather, fp8_recipe
from parallel3d.data_parallel.muon import check_muon, check_muon_model
from parallel3d.data_parallel.quantize import check_zeropp
from parallel3d.mesh import ParallelContext, check_hpz


def default_no_decay(name: str, p: nn.Parameter) -> bool:
    """Parameters without weight decay: 1-D ones (norm weights, biases)."""
    return p.dim() == 1


@dataclass(frozen=True)
class DataParallelConfig:
    """Options of the DistributedOptimizer; the training key each comes from is in `from_train_config`.
    grad_dtype (no training key; None: fp32) is the dtype of the gradient buffers and reductions: the
    model dtype trades accuracy for memory (the ZeRO paper's 2-byte gradients). no_decay (no training
    key; None: `default_no_decay`) picks the parameters AdamW does not decay."""
    zero: int = 0                          # 0 | 1 | 2 | 3 (optimizer.py's table)
    precision: str = "fp32"                # compute dtype: fp32 | bf16 | fp16 (precision.py)
    lr: float = 3e-4                       # step(lr=None) uses it
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    adamw_block: int = 0                   # elements per AdamW block; 0: by device (adamw.block_for)
    bucket_size: int = 0                   # parameters per bucket; build.bucket_elems
    bucket_size_mb: float = 0.0            # > 0 overrides bucket_size
    loss_scale: float = 0.0                # fp16: > 0 static, 0 dynamic
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_window: int = 1000
    min_loss_scale: float = 1.0
    grad_dtype: Optional[torch.dtype] = None
    offload_optimizer: str = "none"        # none | cpu | nvme (offload/homes.py)
    offload_params: str = "none"           # none | cpu | nvme, ZeRO-3 only
    offload_dir: Optional[str] = None
    offload_buffer_mb: float = 64.0
    grad_compression: str = "none"         # none | powersgd | topk (compression.py), ZeRO-0/1
    powersgd_rank: int = 4
    topk_ratio: float = 0.01
    compression_start_step: int = 0
    quantized_weights: bool = False        # ZeRO++ qwZ (ZeRO-3 gathers as int8 blocks)
    hpz: bool = False                      # ZeRO++ hpZ (backward gathers inside the node)
    quantized_gradients: bool = False      # ZeRO++ qgZ (ZeRO-3 reduce-scatter as int8 blocks)
    quant_block: int = 256
    fp8_gather: bool = False               # ZeRO-3 gathers the fp8 linears' weights in fp8
    overlap_param_gather: bool = False     # ZeRO-1/2: gathers after the step waited by the next forward
    optimizer: str = "adamw"               # adamw | muon (muon.py: Muon for ParamMeta.matrix, AdamW for the rest)
    muon_lr: float = 0.0                   # 0: lr; else scaled by the schedule as lr is (muon_step.lr_for)
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_weight_decay: Optional[float] = None   # None: weight_decay
    muon_adjust_lr_fn: str = "match_rms_adamw"  # original | match_rms_adamw (muon.adjust_lr)
    muon_ns_precision: str = "bf16"        # bf16 | fp32: the Newton-Schulz iteration's dtype
    muon_tp_mode: str = "gather"           # gather (exact) | blockwise (each TP shard alone)
    no_decay: Optional[Callable[[str, nn.Parameter], bool]] = None

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"parallel.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        check_offload(self.offload_optimizer, self.offload_params, self.zero, self.offload_dir,
                      self.offload_buffer_mb)
        check_zeropp(self.zero, self.quantized_weights, self.hpz, self.quantized_gradients, self.quant_block)
        check_block(self.adamw_block)
        check_muon(self.optimizer, self.muon_momentum, self.muon_ns_steps, self.muon_adjust_lr_fn,
                   self.muon_ns_precision, self.muon_tp_mode, self.muon_lr, self.muon_decay, self.offload_optimizer)
        object.__setattr__(self, "betas", tuple(self.betas))

    @property
    def muon_decay(self) -> float:
        """Muon's weight decay: muon_weight_decay, or (None) AdamW's."""
        return self.weight_decay if self.muon_weight_decay is None else self.muon_weight_decay

    def check(self, ctx: ParallelContext, modules: Sequence[nn.Module]) -> None:
        """The rules that need the layout or the model (module docstring); raises ValueError."""
        check_offload_device(self.offload_optimizer, self.offload_params, ctx.device)
        check_compression(self.grad_compression, self.zero, self.powersgd_rank, self.topk_ratio,
                          self.compression_start_step, ctx.spec.hsdp, self.precision, ctx.dp_cp.size)
        if self.hpz:
            check_hpz(ctx.spec)
        if self.fp8_gather:
            recipe = fp8_recipe(p for m in modules for p in m.parameters())
            check_fp8_gather(True, self.zero, recipe, self.quantized_weights, self.hpz, "none")
        if self.optimizer == "muon":
            check_muon_model([(n, p) for m in modules for n, p in m.named_parameters()], self.muon_tp_mode)

    @property
    def decay_filter(self) -> Callable[[str, nn.Parameter], bool]:
        """no_decay, or the default rule."""
        return self.no_decay or default_no_decay

    @classmethod
    def from_train_config(cls, cfg: Any) -> "DataParallelConfig":
        """From a training ExperimentConfig (training/config_sections.py; read by attribute, so this layer does
        not import training): every parallel.* and train.* key the optimizer uses."""
        t, p = cfg.train, cfg.parallel
        return cls(zero=p.zero, precision=t.precision, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                   weight_decay=t.weight_decay, adamw_block=t.adamw_block, bucket_size=p.bucket_size,
                   bucket_size_mb=p.bucket_size_mb,
                   loss_scale=t.loss_scale, initial_loss_scale=t.initial_loss_scale,
                   loss_scale_window=t.loss_scale_window, min_loss_scale=t.min_loss_scale,
                   offload_optimizer=p.offload_optimizer, offload_params=p.offload_params,
                   offload_dir=p.offload_dir, offload_buffer_mb=p.offload_buffer_mb,
                   grad_compression=p.grad_compression, powersgd_rank=p.powersgd_rank, topk_ratio=p.topk_ratio,
                   compression_start_step=p.compression_start_step,
                   quantized_weights=p.zero_quantized_weights, hpz=p.zero_hpz,
                   quantized_gradients=p.zero_quantized_gradients, quant_block=p.quant_block,
                   fp8_gather=p.zero3_fp8_gather, overlap_param_gather=p.overlap_param_gather,
                   optimizer=t.optimizer, muon_lr=t.muon_lr or 0.0, muon_momentum=t.muon_momentum,
                   muon_nesterov=t.muon_nesterov, muon_ns_steps=t.muon_ns_steps,
                   muon_weight_decay=t.muon_weight_decay, muon_adjust_lr_fn=t.muon_adjust_lr_fn,
                   muon_ns_precision=t.muon_ns_precision, muon_tp_mode=t.muon_tp_mode)
