"""DataParallelConfig (data_parallel/config.py): the one typed config of the DistributedOptimizer.

- bad input is refused by the rule's owner, with the owner's one message (the config restates no rule),
  at construction for what needs no layout, in the optimizer's construction for what does;
- `from_train_config` maps every training key the optimizer uses: each field not documented as having
  no training key must come from the training config (a dropped or a new, unmapped field fails here).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from parallel3d.data_parallel import DataParallelConfig, DistributedOptimizer, attach
from parallel3d.data_parallel.adamw import check_offload
from parallel3d.data_parallel.compression import check_compression
from parallel3d.data_parallel.quantize import check_zeropp
from parallel3d.mesh import ParallelContext
from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Llama
from parallel3d.training.config import ExperimentConfig, ParallelConfig, TrainConfig
from test_dp_parity import BASE

# field -> the training key it comes from ("train.beta1,train.beta2": a tuple of both)
FROM_TRAINING = {
    "zero": "parallel.zero", "precision": "train.precision", "lr": "train.lr",
    "betas": "train.beta1,train.beta2", "eps": "train.eps", "weight_decay": "train.weight_decay",
    "adamw_block": "train.adamw_block",
    "bucket_size": "parallel.bucket_size", "bucket_size_mb": "parallel.bucket_size_mb",
    "loss_scale": "train.loss_scale", "initial_loss_scale": "train.initial_loss_scale",
    "loss_scale_window": "train.loss_scale_window", "min_loss_scale": "train.min_loss_scale",
    "offload_optimizer": "parallel.offload_optimizer", "offload_params": "parallel.offload_params",
    "offload_dir": "parallel.offload_dir", "offload_buffer_mb": "parallel.offload_buffer_mb",
    "grad_compression": "parallel.grad_compression", "powersgd_rank": "parallel.powersgd_rank",
    "topk_ratio": "parallel.topk_ratio", "compression_start_step": "parallel.compression_start_step",
    "quantized_weights": "parallel.zero_quantized_weights", "hpz": "parallel.zero_hpz",
    "quantized_gradients": "parallel.zero_quantized_gradients", "quant_block": "parallel.quant_block",
    "fp8_gather": "parallel.zero3_fp8_gather", "overlap_param_gather": "parallel.overlap_param_gather",
    "optimizer": "train.optimizer", "muon_lr": "train.muon_lr", "muon_momentum": "train.muon_momentum",
    "muon_nesterov": "train.muon_nesterov", "muon_ns_steps": "train.muon_ns_steps",
    "muon_weight_decay": "train.muon_weight_decay", "muon_adjust_lr_fn": "train.muon_adjust_lr_fn",
    "muon_ns_precision": "train.muon_ns_precision", "muon_tp_mode": "train.muon_tp_mode",
}
NO_TRAINING_KEY = {"grad_dtype", "no_decay"}   # set by code (tests, benchmarks), never by a training key


def _training_value(cfg: ExperimentConfig, keys: str):
    values = [getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in keys.split(",")]
    return tuple(values) if len(values) > 1 else values[0]


# two valid training configs that between them move every mapped key off the dataclass default
SHARDED = ExperimentConfig(
    model=None,
    parallel=ParallelConfig(zero=3, bucket_size=123, bucket_size_mb=0.5, offload_optimizer="cpu",
                            offload_params="cpu", offload_dir="/tmp/offload", offload_buffer_mb=32.0,
                            powersgd_rank=7, topk_ratio=0.02, compression_start_step=5,
                            zero_quantized_weights=True, zero_hpz=True, zero_quantized_gradients=True,
                            quant_block=64, zero3_fp8_gather=True),
    train=TrainConfig(precision="fp16", lr=1e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.05,
                      adamw_block=4096, loss_scale=8.0, initial_loss_scale=1024.0, loss_scale_window=50, min_loss_scale=2.0))
COMPRESSED = ExperimentConfig(model=None, parallel=ParallelConfig(zero=1, grad_compression="powersgd",
                                                                  overlap_param_gather=True),
                              train=TrainConfig(optimizer="muon", muon_lr=0.02, muon_momentum=0.9, muon_nesterov=False,
                                                muon_ns_steps=4, muon_weight_decay=0.01, muon_adjust_lr_fn="original",
                                                muon_ns_precision="fp32", muon_tp_mode="blockwise"))


def test_every_field_has_a_training_key_or_is_documented_without_one():
    fields = {f.name for f in dataclasses.fields(DataParallelConfig)}
    assert set(FROM_TRAINING) | NO_TRAINING_KEY == fields
    assert not set(FROM_TRAINING) & NO_TRAINING_KEY


def test_from_train_config_maps_every_training_key():
    default = DataParallelConfig()
    moved = set()
    for cfg in (SHARDED, COMPRESSED):
        dp = DataParallelConfig.from_train_config(cfg)
        for name, keys in FROM_TRAINING.items():
            assert getattr(dp, name) == _training_value(cfg, keys), (name, keys)
            if getattr(dp, name) != getattr(default, name):
                moved.add(name)
        assert dp.grad_dtype is None and dp.no_decay is None
    assert moved == set(FROM_TRAINING), f"keys never moved off the default: {set(FROM_TRAINING) - moved}"


def _owner_message(fn, *args) -> str:
    with pytest.raises(ValueError) as e:
        fn(*args)
    return str(e.value)


@pytest.mark.parametrize("kwargs,owner", [
    (dict(offload_optimizer="gpu"), lambda: check_offload("gpu", "none", 0, None, 64.0)),
    (dict(offload_params="cpu", zero=2), lambda: check_offload("none", "cpu", 2, None, 64.0)),
    (dict(offload_buffer_mb=0.0), lambda: check_offload("none", "none", 0, None, 0.0)),
    (dict(hpz=True, zero=1), lambda: check_zeropp(1, False, True, False, 256)),
    (dict(quant_block=0), lambda: check_zeropp(0, False, False, False, 0)),
])
def test_construction_refuses_with_the_owners_message(kwargs, owner):
    expected = _owner_message(owner)
    with pytest.raises(ValueError) as e:
        DataParallelConfig(**kwargs)
    assert str(e.value) == expected


def test_zero_out_of_range():
    with pytest.raises(ValueError, match=r"parallel.zero must be 0, 1, 2 or 3, got 4"):
        DataParallelConfig(zero=4)


def _model(ctx):
    model = Llama(ModelConfig(**BASE), ctx)
    model.init_weights(0)
    return model


@pytest.mark.parametrize("kwargs,owner", [
    (dict(grad_compression="bogus"), lambda: check_compression("bogus", 0, 4, 0.01, 0, False, "fp32", 1)),
    (dict(zero=2, grad_compression="powersgd"),
     lambda: check_compression("powersgd", 2, 4, 0.01, 0, False, "fp32", 1)),
])
def test_the_optimizer_refuses_layout_rules_with_the_owners_message(kwargs, owner):
    expected = _owner_message(owner)
    ctx = ParallelContext.single()
    with pytest.raises(ValueError) as e:
        attach([_model(ctx)], ctx, DataParallelConfig(**kwargs))
    assert str(e.value) == expected


def test_meta_device_refuses_offload():
    ctx = ParallelContext.single("meta")
    with torch.device("meta"):
        model = Llama(ModelConfig(**BASE), ctx)
    with pytest.raises(ValueError, match="offload needs host memory"):
        DistributedOptimizer([model], ctx, DataParallelConfig(zero=1, offload_optimizer="cpu"))


def test_fp8_gather_needs_fp8_linears():
    ctx = ParallelContext.single()
    with pytest.raises(ValueError, match=r"zero3_fp8_gather .* \(got zero=3, fp8=none\)"):
        attach([_model(ctx)], ctx, DataParallelConfig(zero=3, fp8_gather=True))


def test_zero3_needs_its_gatherer_attached_first():
    ctx = ParallelContext.single()
    with pytest.raises(ValueError, match=r"parallel.zero=3: .*attach"):
        DistributedOptimizer([_model(ctx)], ctx, DataParallelConfig(zero=3))


def test_adamw_block_changes_no_bit():
    """train.adamw_block only cuts the elementwise update into pieces: any size gives the same weights."""
    from ckpt_helpers import build_trainer, make_config
    from parallel3d.mesh import ParallelContext

    def weights(block: int) -> list:
        torch.manual_seed(0)
        trainer = build_trainer(make_config(["parallel.tp=1", f"train.adamw_block={block}"], 1),
                                ParallelContext.single())
        for _ in range(2):
            trainer.train_step()
        return [p.detach().clone() for c in trainer.chunks for p in c.parameters()]
    by_device, small = weights(0), weights(1000)
    assert all(torch.equal(a, b) for a, b in zip(by_device, small)) and len(small) > 0
