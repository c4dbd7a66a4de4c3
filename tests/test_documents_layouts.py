"""Packed documents through the real Trainer under every layout: the loss equals evaluating each document
alone (world-size-1 model, separate forward passes with positions from 0), and training with masking on
keeps parity with the world-size-1 run (loss rel 1e-5 and grad_norm rel 1e-4 each step, weights rtol 1e-4
after the steps).

The data is the tiny preset's synthetic text with the space byte as EOS: every word is a document, so
each 32-token window holds several documents and a few straddle CP chunk boundaries.
"""
from __future__ import annotations

import pytest
import torch

from ckpt_helpers import build_trainer, context_for, make_config
from doc_helpers import per_document_loss_sum, reference_model
from parity import WEIGHT_ATOL, assemble, assert_close_dicts, assert_grad_norms, local_slices

EOS = 32  # ' '
MASK = ["data.document_masking=true", f"data.eos_id={EOS}", "train.lr=3e-3", "train.eps=1e-4",
        "train.warmup_steps=0", "train.lr_schedule=constant", "train.global_batch_size=4"]
STEPS = 2


def run(worker, overrides, steps: int = STEPS) -> dict:
    torch.set_num_threads(1)
    from launch.common import stage_builder  # what pretrain.py builds (recomputation included)
    from parallel3d.training.trainer import Trainer
    cfg = make_config([*MASK, *overrides], 1 if worker is None else worker.world_size)
    ctx = context_for(cfg, worker)
    trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx))
    records = [trainer.train_step() for _ in range(steps)]
    weights = {}
    for chunk in trainer.chunks:
        weights.update(local_slices(chunk, "data"))
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records], "weights": weights}


@pytest.fixture(scope="module")
def reference():
    cfg = make_config(MASK, 1)
    windows = build_trainer(cfg, context_for(cfg)).sampler.global_batch(0)
    total, count = per_document_loss_sum(reference_model(cfg), windows, EOS)
    ws1 = run(None, [])
    unmasked = run(None, ["data.document_masking=false"], 1)["losses"][0]
    assert abs(ws1["losses"][0] - total / count) <= 1e-5 * total / count, (ws1["losses"][0], total / count)
    assert abs(unmasked - total / count) > 1e-4 * total / count, "the documents must change the loss"
    return ws1


@pytest.mark.parametrize("world,layout", [
    (2, ["parallel.tp=2"]),
    (2, ["parallel.cp=2"]),
    (2, ["parallel.cp=2", "parallel.cp_mode=allgather"]),
    (2, ["parallel.cp=2", "parallel.cp_mode=ulysses"]),
    (4, ["parallel.cp=2", "parallel.tp=2", "parallel.sp=true"]),
    (4, ["parallel.cp=2", "parallel.pp=2", "parallel.zero=1"]),
], ids=["tp2", "cp2-ring", "cp2-allgather", "cp2-ulysses", "cp2-tp2-sp", "cp2-pp2-zero1"])
def test_masked_training_parity(worlds, reference, world, layout):
    """Step 0's loss is the per-document loss (through the reference fixture's check on world size 1);
    every step's loss and the weights after the steps match world size 1."""
    got = worlds.run(world, run, layout)
    for step, (g, e) in enumerate(zip(got[0]["losses"], reference["losses"])):
        assert abs(g - e) <= 1e-5 * abs(e), f"step {step}: loss {g} vs world size 1 {e}"
    assert_grad_norms([r["norms"] for r in got], reference["norms"])
    assert_close_dicts(assemble([r["weights"] for r in got]), assemble([reference["weights"]]), rtol=1e-4,
                       atol=WEIGHT_ATOL, what="weights")


def test_masking_needs_an_eos_id():
    from parallel3d.training.config import ConfigError
    with pytest.raises(ConfigError, match="data.eos_id"):
        make_config(["data.document_masking=true"], 1)
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        make_config(["data.document_masking=true", "data.eos_id=100000"], 1)
    cfg = make_config(["data.document_masking=true", "data.eos_id=5"], 1)
    assert cfg.data.reset_positions is True  # default: on with masking
    assert make_config(["data.document_masking=true", "data.eos_id=5", "data.reset_positions=false"],
                       1).data.reset_positions is False


RESET_ONLY = ["data.document_masking=false", "data.reset_positions=true"]


def _positions(worker, overrides) -> list[torch.Tensor]:
    """The position ids the Trainer feeds its model at step 0, one (b, s/cp) tensor per microbatch."""
    cfg = make_config([*MASK, *overrides], 1 if worker is None else worker.world_size)
    trainer = build_trainer(cfg, context_for(cfg, worker))
    return [mb["position_ids"].cpu() for mb in trainer._microbatches(0)]


def test_positions_restart_without_masking(worlds):
    """data.reset_positions alone (Megatron's reset_position_ids without reset_attention_mask): the model is
    fed positions restarting after each EOS, on every CP rank its shard of them. Under masking RoPE's
    relative angles make the restart a no-op, so the masked loss tests above cannot see it; nor can a loss
    at this size (untrained attention is near uniform: the restart moves step 0's loss by 6e-6)."""
    from parallel3d.context_parallel.documents import document_ids
    from parallel3d.context_parallel.sharding import cp_chunk_indices
    cfg = make_config([*MASK, *RESET_ONLY], 1)
    ids = build_trainer(cfg, context_for(cfg)).sampler.global_batch(0)[:, :-1]   # (b, s)
    want = torch.zeros_like(ids)   # position of each token inside its document, by hand
    for r, row in enumerate(document_ids(ids, EOS)):
        for t in range(1, row.numel()):
            want[r, t] = 0 if row[t] != row[t - 1] else want[r, t - 1] + 1
    assert (want == 0).sum() > ids.shape[0], "the windows must hold several documents for the test to mean something"
    assert torch.equal(torch.cat(_positions(None, RESET_ONLY)), want)
    for plain in _positions(None, ["data.document_masking=false", "data.reset_positions=false"]):
        assert torch.equal(plain, torch.arange(ids.shape[1]))   # (s,): one row of positions for every sequence
    for cp_rank, got in enumerate(worlds.run(2, _positions, [*RESET_ONLY, "parallel.cp=2"])):
        shard = want[:, cp_chunk_indices(ids.shape[1], 2, cp_rank)]   # (b, s/2)
        assert torch.equal(torch.cat(got), shard), f"cp rank {cp_rank}"


def test_masked_loss_with_triton_kernels():
    """model.kernels=triton (the interpreter on CPU, a smaller run): the Triton flash kernel with document
    ids, through the Trainer, gives the per-document loss of the torch world-size-1 model."""
    small = ["train.seq_len=16", "train.global_batch_size=2", "model.num_layers=1"]
    cfg = make_config([*MASK, *small], 1)
    windows = build_trainer(cfg, context_for(cfg)).sampler.global_batch(0)
    total, count = per_document_loss_sum(reference_model(cfg), windows, EOS)
    got = run(None, [*small, "model.kernels=triton"], 1)["losses"][0]
    assert abs(got - total / count) <= 1e-5 * total / count, (got, total / count)


@pytest.mark.parametrize("cp_mode", ["ring", "allgather", "ulysses"])
def test_masked_step_runs_off_the_cpu(cp_mode):
    """The meta-device dry run (tests/test_fake_device.py): document ids reach the attention on the
    compute device, skip decisions read only the host copy, nothing mixes devices."""
    from parallel3d.mesh import MeshSpec, ParallelContext
    overrides = [*MASK, "parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.sp=true",
                 f"parallel.cp_mode={cp_mode}", "train.global_batch_size=8", "model.num_layers=4"]
    cfg = make_config(overrides, 16)
    p = cfg.parallel
    for rank in (0, 15):  # first stage, last stage
        ctx = ParallelContext.simulated(MeshSpec(tp=p.tp, cp=p.cp, dp=p.dp, pp=p.pp), rank, "meta")
        out = build_trainer(cfg, ctx).train_step()
        assert not out["skipped"]


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_masked_training_with_activation_checkpointing(reference, recompute):
    """Recomputation replays the masked attention (the document ids reach the checkpointed block/core)."""
    got = run(None, [f"train.activation_checkpointing={recompute}"])
    assert got["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    assert_grad_norms([got["norms"]], reference["norms"])
