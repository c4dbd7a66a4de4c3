"""Putting model chunks under data parallelism: ZeRO-3's parameter gathering, then the optimizer.

ZeRO-3 is a model-wrapping concern, as FSDP is: `attach_zero3` cuts each chunk into units (build.plan:
the blocks and the chunk's root, one rows-layout bucket per unit and group) and hooks the gathers and
frees into their forward and backward (zero3.py), on clones of the shard groups (and hpZ's node groups).
The optimizer then receives the gatherer: its buckets are the gradient buckets it reduces, and its
construction moves each unit's parameters into the persistent shards and frees them (build.init_bucket;
the values are read first, so build the optimizer right after attaching). `attach` does both, and is
what the Trainer, the tests and the benchmarks call:

    opt = attach(chunks, ctx, DataParallelConfig.from_train_config(cfg))
"""
from __future__ import annotations

from typing import Sequence

from torch import nn

from parallel3d.data_parallel.build import plan
from parallel3d.data_parallel.config import DataParallelConfig
from parallel3d.data_parallel.optimizer import DistributedOptimizer
from parallel3d.data_parallel.precision import compute_dtype
from parallel3d.data_parallel.zero3 import Zero3, ZeroPP
from parallel3d.mesh import ParallelContext


def attach_zero3(modules: Sequence[nn.Module], ctx: ParallelContext, config: DataParallelConfig) -> Zero3:
    """ZeRO-3's gatherer on the chunks (config.zero must be 3); the optimizer built next takes it."""
    if config.zero != 3:
        raise ValueError(f"attach_zero3 is ZeRO-3's parameter gathering; parallel.zero={config.zero} has none")
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    seqs, chains = plan(modules, ctx, 3, config.decay_filter, 0)
    gather = {e: ctx.clone("edp_shard" if e else "dp_shard") for e in (False, True)}
    node = {e: ctx.clone("edp_node" if e else "dp_node") for e in (False, True)} if config.hpz else None
    pp = ZeroPP(config.quant_block if config.quantized_weights else 0, node, config.fp8_gather)
    return Zero3(chains, seqs, gather, compute_dtype(config.precision), pp)


def attach(modules: Sequence[nn.Module], ctx: ParallelContext, config: DataParallelConfig) -> DistributedOptimizer:
    """The chunks under data parallelism: ZeRO-3's gathering attached when config.zero == 3, then the
    DistributedOptimizer over them."""
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    zero3 = attach_zero3(modules, ctx, config) if config.zero == 3 else None
    return DistributedOptimizer(modules, ctx, config, zero3)
