"""Config validation against a world size: one ConfigError per broken constraint, before any process group.

Each rule has one owner elsewhere (the mesh, the pipeline partition and schedules, the TP/CP/EP layers, the
optimizer); validation calls it through `_owned` and only adds the cross-field rules nobody else owns.
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Any, Optional, Sequence

from parallel3d.context_parallel.attention import CP_MODES
from parallel3d.context_parallel.sharding import check_seq_len
from parallel3d.data_parallel.adamw import OFFLOAD_MODES, check_block, check_offload
from parallel3d.data_parallel.compression import MODES as COMPRESSION_MODES, check_compression
from parallel3d.data_parallel.muon import ADJUST_LR, NS_PRECISIONS, OPTIMIZERS, TP_MODES, check_muon
from parallel3d.data_parallel.precision import DTYPES
from parallel3d.tensor_parallel.fp8 import RECIPES as FP8_RECIPES, check_fp8
from parallel3d.expert_parallel.experts import check_expert_split, experts_replicated_over_tp
from parallel3d.data_parallel.quantize import check_zeropp
from parallel3d.mesh_spec import MeshSpec, check_hpz, check_node_size
from parallel3d.data_parallel.fp8_gather import check_fp8_gather
from parallel3d.pipeline.head_form import head_form_of
from parallel3d.pipeline.partition import partition_layers
from parallel3d.pipeline.placement import check_schedule_config
from parallel3d.pipeline.schedules import SCHEDULE_NAMES, SPLIT_BACKWARD
from parallel3d.pipeline.timeline import FORMATS as TIMELINE_FORMATS
from parallel3d.tensor_parallel.layers import check_kv_split
from parallel3d.training.config import ConfigError, ExperimentConfig, copied, timeline_window
from parallel3d.training.data_sources import resolve_documents
from parallel3d.training.lr_schedule import LR_SCHEDULES

# Every key with a closed set of values -> that set, each read from its owner. Validation checks values
# against these tuples (or the owner's check does) and docs/configuration.md lists them (launch/config_doc.py).
CHOICES: dict[str, tuple] = {
    "parallel.cp_mode": CP_MODES,
    "parallel.zero": (0, 1, 2, 3),
    "parallel.schedule": SCHEDULE_NAMES,
    "parallel.offload_optimizer": OFFLOAD_MODES,
    "parallel.offload_params": OFFLOAD_MODES,
    "parallel.grad_compression": COMPRESSION_MODES,
    "train.precision": tuple(DTYPES),
    "train.lr_schedule": LR_SCHEDULES,
    "train.activation_checkpointing": ("none", "full", "selective"),
    "train.fp8": FP8_RECIPES,
    "train.nan_policy": ("skip", "stop"),
    "train.optimizer": OPTIMIZERS,
    "train.muon_adjust_lr_fn": ADJUST_LR,
    "train.muon_ns_precision": tuple(NS_PRECISIONS),
    "train.muon_tp_mode": TP_MODES,
}


class ConfigWarning(UserWarning):
    """A valid config with a clearly better choice; the message names the keys and that choice."""


def _choice(value: Any, key: str, allowed: Sequence[Any]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, allowed))}")


def _owned(check: Any, prefix: str = "") -> Any:
    """Run a rule's owner (a function raising ValueError) and turn its error into one ConfigError."""
    try:
        return check()
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{prefix}{e}") from None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def require_package(module: str, feature: str, pip_name: Optional[str] = None) -> None:
    """An optional feature asked for without its package: one message naming what to install."""
    if importlib.util.find_spec(module) is None:
        name = pip_name or module
        raise ConfigError(f"{feature} needs the {name!r} package, which is not installed: pip install {name}")


def resolve_and_validate(cfg: ExperimentConfig, world_size: int,
                         ranks_per_node: Optional[int] = None) -> ExperimentConfig:
    """Return a resolved copy of `cfg` (dp and train.num_microbatches filled in; sp turned off when
    tp == 1, where it is a no-op; model.fused_head_form=auto resolved from the schedule) after checking
    every cross-field constraint for `world_size`.
    ranks_per_node: the launcher's ranks per node (torchrun's LOCAL_WORLD_SIZE), checked against
    parallel.gpus_per_node (mesh_spec.check_node_size); None outside a launcher (plans, tests).

    Raises ConfigError with one message naming the first broken constraint. `cfg` itself is left
    untouched, so the unresolved config stays portable to other world sizes.
    """
    cfg = copied(cfg)
    p, t, m = cfg.parallel, cfg.train, cfg.model
    try:
        m.validate()
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _require(world_size >= 1, f"world size must be >= 1, got {world_size}")
    for name in ("tp", "pp", "cp", "ep", "etp", "virtual_stages"):
        _require(getattr(p, name) >= 1, f"parallel.{name} must be >= 1, got {getattr(p, name)}")
    _require(p.dp >= 0, f"parallel.dp must be >= 0 (0: fill from the world size), got {p.dp}")
    _choice(p.cp_mode, "parallel.cp_mode", CHOICES["parallel.cp_mode"])
    _choice(p.schedule, "parallel.schedule", CHOICES["parallel.schedule"])
    _choice(p.zero, "parallel.zero", CHOICES["parallel.zero"])
    _require(isinstance(p.bucket_size, int) and p.bucket_size >= 0,
             f"parallel.bucket_size must be an integer >= 0 (parameters per bucket; 0: max(40M, 1M x DP x CP)), "
             f"got {p.bucket_size!r}")
    _require(p.bucket_size_mb >= 0, f"parallel.bucket_size_mb must be >= 0 (0: unset, parallel.bucket_size "
                                    f"applies), got {p.bucket_size_mb}")
    _require(not p.overlap_param_gather or p.zero in (1, 2),
             f"parallel.overlap_param_gather=true needs parallel.zero=1 or 2 (the gathers after the step), got "
             f"parallel.zero={p.zero} (ZeRO-3 already gathers around each unit's use)")
    _require(p.timeout_s > 0, f"parallel.timeout_s must be > 0 (seconds), got {p.timeout_s}")
    _owned(lambda: check_offload(p.offload_optimizer, p.offload_params, p.zero, p.offload_dir, p.offload_buffer_mb))
    _owned(lambda: check_block(t.adamw_block))
    _owned(lambda: check_muon(t.optimizer, t.muon_momentum, t.muon_ns_steps, t.muon_adjust_lr_fn, t.muon_ns_precision,
                              t.muon_tp_mode, t.muon_lr or 0.0, t.weight_decay if t.muon_weight_decay is None
                              else t.muon_weight_decay, p.offload_optimizer))
    _choice(t.precision, "train.precision", CHOICES["train.precision"])
    hd = m.head_dim or m.hidden_size // m.num_heads
    _owned(lambda: check_fp8(t.fp8, t.precision, {
        "model.hidden_size": m.hidden_size, "model.ffn_hidden_size/tp": m.ffn_hidden_size // max(p.tp, 1),
        "num_heads*head_dim/tp": m.num_heads * hd // max(p.tp, 1)}))
    _choice(t.activation_checkpointing, "train.activation_checkpointing", CHOICES["train.activation_checkpointing"])
    _require(t.recompute_layers >= 0, f"train.recompute_layers must be >= 0 (layers per pipeline chunk recomputed "
                                      f"whole), got {t.recompute_layers}")
    _require(not (t.recompute_layers and t.activation_checkpointing == "full"),
             f"train.recompute_layers={t.recompute_layers} has no effect with train.activation_checkpointing=full "
             f"(every layer is recomputed); set activation_checkpointing=none or selective for the other layers")
    _choice(t.nan_policy, "train.nan_policy", CHOICES["train.nan_policy"])
    _choice(t.lr_schedule, "train.lr_schedule", CHOICES["train.lr_schedule"])
    for name in ("micro_batch_size", "global_batch_size", "seq_len"):
        _require(getattr(t, name) >= 1, f"train.{name} must be >= 1, got {getattr(t, name)}")
    for name in ("steps", "warmup_steps", "lr_decay_steps", "eval_interval", "eval_steps"):
        _require(getattr(t, name) >= 0, f"train.{name} must be >= 0, got {getattr(t, name)}")
    _require(0 <= t.min_lr <= t.lr, f"train.min_lr={t.min_lr} must be in [0, train.lr={t.lr}]")

    # --- world size and degrees (rank order tp, cp, dp, pp: docs/architecture.md section 2.1); the mesh owns the rules
    if p.ep > 1:
        _require(m.num_experts > 0, f"parallel.ep={p.ep} needs a MoE model (model.num_experts > 0)")
    if p.etp > 1:
        _require(m.num_experts > 0, f"parallel.etp={p.etp} needs a MoE model (model.num_experts > 0)")
    spec = _owned(lambda: MeshSpec.for_world(world_size, p.tp, p.cp, p.pp, p.ep, p.dp, p.dp_shard,
                                             p.gpus_per_node, p.etp))
    p.dp = spec.dp   # dp_shard stays as given (0: all of dp), so a saved config stays portable
    if ranks_per_node is not None:
        _owned(lambda: check_node_size(p.gpus_per_node, world_size, ranks_per_node))
    _owned(lambda: check_compression(p.grad_compression, p.zero, p.powersgd_rank, p.topk_ratio,
                                     p.compression_start_step, spec.hsdp, t.precision, spec.dp * spec.cp))
    _owned(lambda: check_zeropp(p.zero, p.zero_quantized_weights, p.zero_hpz, p.zero_quantized_gradients,
                                p.quant_block))
    if p.zero_hpz:
        _owned(lambda: check_hpz(spec))
    _owned(lambda: check_fp8_gather(p.zero3_fp8_gather, p.zero, t.fp8, p.zero_quantized_weights, p.zero_hpz,
                                    t.activation_checkpointing))

    # --- attention heads under TP / Ulysses CP
    heads, kv = m.num_heads, m.num_kv_heads
    _require(heads % p.tp == 0, f"model.num_heads={heads} is not divisible by parallel.tp={p.tp}")
    _owned(lambda: check_kv_split(kv, p.tp))
    if p.cp > 1 and p.cp_mode == "ulysses":
        _require((heads // p.tp) % p.cp == 0,
                 f"cp_mode=ulysses needs the heads per tp rank (model.num_heads/tp = {heads}/{p.tp} "
                 f"= {heads // p.tp}) divisible by parallel.cp={p.cp}")

    # --- sequence length under CP / SP
    _require(t.seq_len <= m.max_seq_len, f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if p.cp > 1:
        _owned(lambda: check_seq_len(t.seq_len, p.cp), "train.seq_len: ")
    if p.sp and p.tp == 1:
        p.sp = False                 # sequence parallelism over one rank is the identity
    if p.sp:
        _require(t.seq_len % (p.tp * p.cp) == 0,
                 f"train.seq_len={t.seq_len} must be divisible by tp*cp = {p.tp}*{p.cp} with "
                 f"sequence parallelism (each CP rank's seq_len/cp tokens are split across tp ranks)")

    # --- experts
    experts, top_k = m.num_experts, m.moe_top_k
    if experts:
        _owned(lambda: check_expert_split(experts, m.moe_ffn_hidden_size or m.ffn_hidden_size, p.ep, p.etp))
        _require(1 <= top_k <= experts, f"model.moe_top_k={top_k} must be in [1, model.num_experts={experts}]")
        replicated = experts_replicated_over_tp(p.tp, p.ep, p.etp, experts,
                                                m.moe_ffn_hidden_size or m.ffn_hidden_size)
        if replicated:
            warnings.warn(replicated, ConfigWarning, stacklevel=2)

    # --- batch
    per_step = t.micro_batch_size * p.dp
    _require(t.global_batch_size % per_step == 0,
             f"train.global_batch_size={t.global_batch_size} is not divisible by "
             f"micro_batch_size*dp = {t.micro_batch_size}*{p.dp} = {per_step}")
    nmb = t.global_batch_size // per_step
    _require(t.num_microbatches in (0, nmb),
             f"train.num_microbatches={t.num_microbatches} disagrees with global_batch_size/"
             f"(micro_batch_size*dp) = {nmb}; leave it 0 to derive it")
    t.num_microbatches = nmb

    # --- pipeline (each schedule's requirements, the partition and the V placement: parallel3d.pipeline)
    v = _owned(lambda: check_schedule_config(p.schedule, p.pp, p.virtual_stages, nmb))
    if m.fused_head_form == "auto":  # the head's loss form from the schedule's actions (pipeline/head_form.py)
        m.fused_head_form = head_form_of(p.schedule, p.pp, nmb, p.virtual_stages)
    if p.pp > 1 and p.zero == 3:
        from parallel3d.data_parallel.zero3 import check_split_backward
        _owned(lambda: check_split_backward(p.schedule in SPLIT_BACKWARD), f"schedule={p.schedule}: ")
    if m.moe_delay_wgrad:
        from parallel3d.expert_parallel.delayed_wgrad import check_delay_wgrad
        _owned(lambda: check_delay_wgrad(p.ep, p.etp))
    if p.ep_overlap:
        from parallel3d.pipeline.pairing import check_ep_overlap
        _owned(lambda: check_ep_overlap(p.schedule, p.ep, p.zero, p.offload_params, p.pp))
    try:  # the partition owns what a stage may hold (empty first/last stages are fine)
        partition_layers(m.num_layers, p.pp, v, p.layers_per_stage)
    except ValueError as e:
        raise ConfigError(f"pipeline split (model.num_layers={m.num_layers}, parallel.pp={p.pp}, "
                          f"{v} chunk(s) per rank, parallel.layers_per_stage="
                          f"{p.layers_per_stage}): {e}") from None

    # --- data: mixture spec, packed documents (eos id from the token files' metadata when not given)
    _owned(lambda: resolve_documents(cfg.data, m.vocab_size))

    # --- checkpoints and logging
    for name in ("interval", "keep"):
        _require(getattr(cfg.checkpoint, name) >= 0,
                 f"checkpoint.{name} must be >= 0, got {getattr(cfg.checkpoint, name)}")
    _require(cfg.log.interval >= 1, f"log.interval must be >= 1, got {cfg.log.interval}")
    if cfg.log.timeline is not None:
        _require(os.path.splitext(cfg.log.timeline)[1] in TIMELINE_FORMATS,
                 f"log.timeline={cfg.log.timeline} must end in one of {', '.join(TIMELINE_FORMATS)}")
        _require(-1 <= cfg.log.timeline_step < max(t.steps, 1),
                 f"log.timeline_step={cfg.log.timeline_step} must be -1 (the last step) or in [0, train.steps={t.steps})")
        window = timeline_window(cfg.log, t.steps)
        _require(cfg.log.timeline_steps >= 1 and window.start >= 0,
                 f"log.timeline_steps={cfg.log.timeline_steps} must be in [1, {window.stop}]: the steps it records end "
                 f"at step {window.stop - 1} (log.timeline_step={cfg.log.timeline_step}, 0-based)")
    if cfg.log.tensorboard:
        require_package("tensorboard", f"log.tensorboard={cfg.log.tensorboard}")
    if m.attention == "flash_attn":
        require_package("flash_attn", "model.attention=flash_attn", "flash-attn")
    return cfg


def check_simulated_rank(rank: Optional[int], world_size: Optional[int], launcher_world: int) -> None:
    """launch/pretrain.py's --simulate-rank K --world-size N: one rank of an N-rank layout alone, no torchrun.
    `launcher_world`: torchrun's WORLD_SIZE (1 without it). Whether N fits the layout is the mesh's rule
    (resolve_and_validate at world size N); this owns the flags."""
    _require(rank is not None, f"--world-size {world_size} goes with --simulate-rank K (the rank to run alone); "
                               f"under torchrun the world size is torchrun's")
    _require(world_size is not None, f"--simulate-rank {rank} needs --world-size N: the world of the layout "
                                     f"rank {rank} belongs to")
    _require(launcher_world == 1, f"--simulate-rank runs one rank alone, without torchrun; this process is one "
                                  f"of WORLD_SIZE={launcher_world} launched ranks (run it with plain python)")
    _require(world_size >= 1, f"--world-size must be >= 1, got {world_size}")
    _require(0 <= rank < world_size, f"--simulate-rank {rank} is outside the world of size {world_size} "
                                     f"(ranks 0 to {world_size - 1})")


def check_simulated_config(cfg: ExperimentConfig) -> None:
    """What a simulated rank (check_simulated_rank) cannot do: its weights train on stand-ins for its peers'
    messages, so a checkpoint of them is worth nothing, and a checkpoint's other shards have no process to
    load them (a load is collective over every rank)."""
    for key in ("save_dir", "load_dir"):
        value = getattr(cfg.checkpoint, key)
        _require(value is None, f"checkpoint.{key}={value}: --simulate-rank saves and loads no checkpoints (one "
                                f"rank alone, its peers' messages stood in for); leave checkpoint.{key} unset")
