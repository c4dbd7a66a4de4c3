"""train.compile=true: every transformer block compiled in place (torch.compile, inductor on this CPU),
through the CLI's stage builder and the real Trainer: loss, grad_norm and weights after 2 AdamW steps equal
eager's.
Kept to one tiny model (CPU inductor compiles slowly); activation checkpointing runs through it."""
from __future__ import annotations

import torch

from ckpt_helpers import make_config
from parity import WEIGHT_ATOL, assemble, assert_close_dicts, assert_grad_norms, local_slices

PARITY = ["train.lr=3e-3", "train.eps=1e-4", "train.warmup_steps=0", "train.lr_schedule=constant",
          "model.num_layers=2", "train.seq_len=16", "train.global_batch_size=2", "train.activation_checkpointing=full"]


def _train(compile_blocks: bool):
    from launch.common import stage_builder
    from parallel3d.mesh import ParallelContext
    from parallel3d.training.trainer import Trainer

    torch.set_num_threads(1)
    cfg = make_config([*PARITY, f"train.compile={str(compile_blocks).lower()}"], 1)
    trainer = Trainer(cfg, ParallelContext.single(), stage_builder(cfg, ParallelContext.single()))
    records = [trainer.train_step() for _ in range(2)]
    weights = {}
    for chunk in trainer.chunks:
        weights.update(local_slices(chunk, "data"))
    return [r["loss"] for r in records], [r["grad_norm"] for r in records], assemble([weights])


def test_compiled_blocks_match_eager_through_trainer():
    torch._dynamo.reset()
    got, got_n, got_w = _train(True)
    ref, ref_n, ref_w = _train(False)
    assert all(b._compiled_call_impl is not None for b in _blocks_of_compiled()), "blocks must be compiled"
    for g, e in zip(got, ref):
        assert abs(g - e) <= 1e-5 * abs(e), f"compiled loss {g} vs eager {e}"
    assert_grad_norms([got_n], ref_n, what="compiled vs eager")
    assert_close_dicts(got_w, ref_w, rtol=1e-4, atol=WEIGHT_ATOL, what="weights")


def _blocks_of_compiled():
    from launch.common import stage_builder
    from parallel3d.mesh import ParallelContext

    cfg = make_config([*PARITY, "train.compile=true"], 1)
    stage = stage_builder(cfg, ParallelContext.single())(list(range(2)), True, True)
    return list(stage.layers.values())
