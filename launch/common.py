"""Shared start-up for the launch scripts: config, validation before any process group, context, model."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from typing import NoReturn, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.checkpoint.store import CheckpointError  # noqa: E402
from parallel3d.comm import CollectiveError  # noqa: E402
from parallel3d.host_memory import keep_freed_memory  # noqa: E402
from parallel3d.mesh import MeshSpec, ParallelContext, init_distributed  # noqa: E402
from parallel3d.training.config import ConfigError, ExperimentConfig, load_config  # noqa: E402
from parallel3d.training.validate import (ConfigWarning, check_simulated_config, check_simulated_rank,  # noqa: E402
                                          resolve_and_validate)
from parallel3d.training.data import DataError  # noqa: E402
from parallel3d.training.trainer import NonFiniteError  # noqa: E402

USER_ERRORS = (ConfigError, CheckpointError, DataError, ValueError, FileNotFoundError)
# After start-up: also a collective that timed out, and a non-finite step under train.nan_policy=stop.
RUN_ERRORS = USER_ERRORS + (CollectiveError, NonFiniteError)


def fail(message: str, code: int = 2, every_rank: bool = False) -> NoReturn:
    """One line on stderr and a non-zero exit. Start-up errors are the same on every rank, so rank 0 says
    it once; a run-time error (every_rank) may happen on one rank only, so whichever rank meets it says it."""
    rank = os.environ.get("RANK", "0")
    if every_rank or rank == "0" or "RANK" not in os.environ:
        print(f"error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def parse_args(description: str, argv=None, simulate: bool = False) -> tuple[argparse.Namespace, list[str]]:
    """`simulate`: also --simulate-rank K --world-size N (launch/pretrain.py: one rank of a layout alone)."""
    parser = argparse.ArgumentParser(description=description,
                                     epilog="Overrides are dotted key=value pairs, e.g. parallel.tp=2 train.steps=10")
    parser.add_argument("--config", help="YAML preset, e.g. configs/tiny.yaml (or CKPT/config.yaml)")
    if simulate:
        parser.add_argument("--simulate-rank", type=int, default=None, metavar="K",
                            help="run rank K of a --world-size N layout alone on this machine's device (no "
                                 "torchrun): its real step, every collective answered locally")
        parser.add_argument("--world-size", type=int, default=None, metavar="N",
                            help="--simulate-rank: the world size of the layout the rank belongs to")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    args = parser.parse_intermixed_args(argv)  # key=value overrides may come before or after options
    bad = [o for o in args.overrides if "=" not in o]
    if bad:
        parser.error(f"overrides must look like key=value, got {bad}")
    return args, args.overrides


def load_and_validate(config: str | None, overrides: list[str], simulate_rank: Optional[int] = None,
                      world_size: Optional[int] = None) -> ExperimentConfig:
    """Everything that can be checked without processes; raises a user error with one clear message.
    `simulate_rank`, `world_size`: pretrain.py's --simulate-rank K --world-size N (validate.check_simulated_rank):
    the layout is then checked against N instead of torchrun's WORLD_SIZE."""
    launcher_world = int(os.environ.get("WORLD_SIZE", "1"))
    simulated = simulate_rank is not None or world_size is not None
    if simulated:
        check_simulated_rank(simulate_rank, world_size, launcher_world)
    if config is None:
        load_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("checkpoint.load_dir=")), None)
        if load_dir and os.path.isdir(load_dir):
            from parallel3d.checkpoint.load import resolve_checkpoint_dir
            candidate = os.path.join(resolve_checkpoint_dir(load_dir), "config.yaml")
            config = candidate if os.path.isfile(candidate) else None
    if config is not None and not os.path.isfile(config):
        raise ConfigError(f"config file {config} does not exist")
    cfg = load_config(config, overrides, ModelConfig)
    local = os.environ.get("LOCAL_WORLD_SIZE")   # torchrun's ranks on this node (none when simulated)
    with warnings.catch_warnings():   # the same config warning on every rank: rank 0 says it once, as fail()
        if os.environ.get("RANK", "0") != "0":
            warnings.simplefilter("ignore", ConfigWarning)
        cfg = resolve_and_validate(cfg, world_size if simulated else launcher_world,
                                   None if simulated or not local else int(local))
    if simulated:
        check_simulated_config(cfg)
    if cfg.data.path is not None and not os.path.isfile(cfg.data.path):
        raise DataError(f"data.path {cfg.data.path} does not exist")
    from parallel3d.training.data_sources import token_paths
    for path in token_paths(cfg.data):
        if not os.path.isfile(path):
            raise DataError(f"data.paths: token file {path} does not exist")
    if cfg.checkpoint.load_dir is not None and not os.path.isdir(cfg.checkpoint.load_dir):
        raise CheckpointError(f"checkpoint.load_dir {cfg.checkpoint.load_dir} does not exist")
    return cfg


def exit_cleanly_on_sigterm(cfg: ExperimentConfig) -> None:
    """NVMe offload files are removed at exit (atexit); torchrun ends the other workers of a failed job
    with SIGTERM, which by default skips atexit. Turn it into SystemExit, so they are removed then too."""
    p = cfg.parallel
    if "nvme" in (p.offload_optimizer, p.offload_params):
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def build_context(cfg: ExperimentConfig, simulate_rank: Optional[int] = None) -> ParallelContext:
    """The run's context: torchrun's process groups, or (`simulate_rank`, validated) that rank of the layout
    alone on this machine's device (the first GPU, else the CPU), its groups answered by the simulated backend
    standing for the backend a real run there takes (NCCL on CUDA, gloo on CPU)."""
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
    p = cfg.parallel
    spec = MeshSpec.of(p)
    if simulate_rank is not None:
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        ctx = ParallelContext.simulated(spec, simulate_rank, device, "nccl" if cuda else "gloo")
    else:
        init_distributed(timeout_s=p.timeout_s)
        ctx = ParallelContext.build(spec, timeout_s=p.timeout_s)
    if ctx.device.type == "cpu":   # the tensors live in host memory: reuse it as CUDA's caching allocator would
        keep_freed_memory()
    return ctx


def stage_builder(cfg: ExperimentConfig, ctx: ParallelContext):
    """build_stage(layer_ids, pre, post) for the trainer: the dense Llama or the MoE transformer."""
    p, recompute = cfg.parallel, cfg.train.activation_checkpointing
    if cfg.model.num_experts:
        from parallel3d.models.moe import MoETransformer as model_cls
    else:
        from parallel3d.models.llama import Llama as model_cls

    def build(layer_ids: list[int], pre: bool, post: bool):
        if cfg.model.attention == "flex":   # before any rank starts a step (torch raises at the backward)
            from parallel3d.kernels.flex_backend import check_flex
            check_flex(ctx.device, needs_grad=True)
        model = model_cls(cfg.model, ctx, layers=layer_ids, pre=pre, post=post, sequence_parallel=p.sp,
                          cp_mode=p.cp_mode, recompute=recompute, compile_blocks=cfg.train.compile)
        if cfg.train.fp8 != "none":
            from parallel3d.tensor_parallel.fp8 import Fp8Casts
            from parallel3d.tensor_parallel.layers import convert_to_fp8
            convert_to_fp8(model, cfg.train.fp8, Fp8Casts(cfg.model.kernels))  # the trainer opens it per step
        return model
    return build


def shutdown() -> None:
    """Tear the process groups down cleanly, while the interpreter is fully alive.

    Worker aborts at exit ("terminate called without an active exception", SIGABRT) came from gloo process
    groups destroyed during interpreter finalisation: the trainer, optimizer hooks and model form reference
    cycles that hold the ParallelContext (and through it every group), so they were only freed by the
    final garbage collection, after parts of the runtime were gone. The caller drops its references
    first; here the cycles are collected, every rank waits for the others (no peer may still be using a
    connection), the groups are destroyed, and what held them is collected now, not at exit."""
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_initialized():
        try:
            dist.barrier()
        except RuntimeError:
            pass  # a peer is already gone (error path): nothing to wait for
        dist.destroy_process_group()
    gc.collect()
