"""ZeRO++ for ZeRO-3: qwZ (int8 parameter all-gather), hpZ (backward gather inside the node), qgZ (int8
all-to-all gradient reduce-scatter).

hpZ is lossless: parity with the world-size-1 run through the Trainer (like any layout). qwZ and qgZ are
lossy: their bytes are asserted exactly here, their accuracy against the exact run over a short run here
and over hundreds of steps in tests/test_convergence.py.
"""
from __future__ import annotations

import pytest
import torch

from ckpt_helpers import build_trainer, context_for, make_config
from parallel3d.data_parallel.quantize import dequantize, padded, quantize
from parallel3d.training.config import ConfigError
from test_hsdp import run
from test_trainer_regressions import assert_parity

STEPS = 3
BLOCK = 64


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_quantize_error_is_half_a_step_per_block(scale_dtype):
    """Half a step of the scale the receiver sees: bf16 weights' scales travel in bf16, so the values are
    quantised with the rounded scale (quantising with the exact one and dequantising with the rounded one
    errs by up to 127 of its rounding errors more)."""
    x = torch.randn(3, 4 * BLOCK) * torch.logspace(-3, 1, 4 * BLOCK)   # blocks of very different scales
    q, scale = quantize(x, BLOCK, scale_dtype)
    assert q.dtype == torch.int8 and scale.shape == (3, 4) and scale.dtype == scale_dtype
    err = (dequantize(q, scale, BLOCK) - x).abs().view(3, 4, BLOCK).amax(-1)
    assert (err <= scale.float() / 2 * (1 + 1e-6)).all()
    assert (scale > 0).all() and not torch.equal(dequantize(q, scale, BLOCK), x)


@pytest.fixture(scope="module")
def ref():
    return run(None, ["train.global_batch_size=8"], STEPS)


@pytest.mark.parametrize("layout", [
    ["parallel.zero_hpz=true", "parallel.gpus_per_node=2"],
    ["parallel.zero_hpz=true", "parallel.gpus_per_node=2", "parallel.dp_shard=2", "model.num_layers=2"],
    ["parallel.zero_hpz=true", "parallel.gpus_per_node=2", "train.activation_checkpointing=full"],
    ["parallel.zero_hpz=true", "parallel.gpus_per_node=1", "parallel.pp=2", "parallel.dp_shard=2"],
], ids=["hpz", "hpz-hsdp", "hpz-recompute", "hpz-pp2-node1"])
def test_hpz_is_exact_through_trainer(worlds, ref, layout):
    assert_parity(worlds.run(4, run, ["parallel.zero=3", "train.global_batch_size=8", *layout], STEPS), ref)


def _bytes(worker, overrides):
    torch.set_num_threads(1)
    cfg = make_config(["train.global_batch_size=8", "parallel.zero=3", f"parallel.quant_block={BLOCK}", *overrides],
                      worker.world_size)
    trainer = build_trainer(cfg, context_for(cfg, worker))
    rec = trainer.train_step()
    segs = [(b.nshard, b.seg) for b in trainer.optimizer.buckets]
    return rec["comm_bytes"], rec["loss"], segs, cfg.train.num_microbatches


def test_hpz_backward_gathers_stay_in_the_node(worlds):
    """dp=4, gpus_per_node=2: forward gathers over the 4 DP ranks, backward ones over the 2 on this node,
    from the secondary copy the forward left (every microbatch: 2 per step)."""
    for (hpz, _, segs, nmb), (base, _, _, _) in zip(worlds.run(4, _bytes, ["parallel.zero_hpz=true",
                                                                           "parallel.gpus_per_node=2"]),
                                                    worlds.run(4, _bytes, [])):
        full = sum(n * s * 4 for n, s in segs)
        assert nmb == 2 and base["dp_cp.all_gather"] == 2 * nmb * full
        assert hpz["dp_cp.all_gather"] == nmb * full            # forward only
        assert hpz["dp_node.all_gather"] == nmb * full          # backward, inside the node
        assert hpz["dp_cp.reduce_scatter"] == base["dp_cp.reduce_scatter"]


@pytest.mark.parametrize("precision,scale_bytes,exact_bytes", [("bf16", 2, 2), ("fp32", 4, 4)])
def test_qwz_gathers_int8_blocks_and_one_scale_per_block(worlds, precision, scale_bytes, exact_bytes):
    quant = worlds.run(2, _bytes, ["parallel.zero_quantized_weights=true", f"train.precision={precision}"])
    exact = worlds.run(2, _bytes, [f"train.precision={precision}"])
    for (q, q_loss, segs, nmb), (e, e_loss, _, _) in zip(quant, exact):
        gathers = 2 * nmb                                       # forward + backward, every microbatch
        wire = gathers * sum(n * (padded(s, BLOCK) + padded(s, BLOCK) // BLOCK * scale_bytes) for n, s in segs)
        assert q["dp_cp.all_gather"] == wire
        assert e["dp_cp.all_gather"] == gathers * sum(n * s * exact_bytes for n, s in segs)
        ratio = q["dp_cp.all_gather"] / e["dp_cp.all_gather"]
        assert ratio < (0.53 if precision == "bf16" else 0.27), ratio   # ~1/2 of bf16, ~1/4 of fp32
        assert q["dp_cp.reduce_scatter"] == e["dp_cp.reduce_scatter"]  # gradients unchanged
        assert q_loss != e_loss and abs(q_loss - e_loss) < 1e-2 * abs(e_loss)


def test_qgz_reduces_with_an_int8_all_to_all(worlds):
    quant = worlds.run(2, _bytes, ["parallel.zero_quantized_gradients=true"])
    exact = worlds.run(2, _bytes, [])
    for (q, _, segs, nmb), (e, _, _, _) in zip(quant, exact):
        # this rank sends N rows of padded(S) int8 values + fp32 scales (the all-to-all's input), once per
        # microbatch (ZeRO-3 reduces every backward's gradients, data_parallel/sync.py)
        assert nmb == 4
        assert q["dp_cp.all_to_all"] == nmb * sum(n * (padded(s, BLOCK) + padded(s, BLOCK) // BLOCK * 4)
                                                  for n, s in segs)
        assert "dp_cp.reduce_scatter" not in q
        assert e["dp_cp.reduce_scatter"] == nmb * sum(n * s * 4 for n, s in segs)
        assert q["dp_cp.all_gather"] == e["dp_cp.all_gather"]


def test_all_three_close_to_exact_after_a_few_steps(worlds, ref):
    """qwZ + hpZ + qgZ together, under HSDP (dp_shard=2), 3 steps: the losses stay within 1% of the exact
    run (long runs: tests/test_convergence.py)."""
    got = worlds.run(4, run, ["parallel.zero=3", "train.global_batch_size=8", "parallel.zero_quantized_weights=true",
                              "parallel.zero_hpz=true", "parallel.gpus_per_node=2",
                              "parallel.zero_quantized_gradients=true", "parallel.dp_shard=2"], STEPS)
    for g, e in zip(got[0]["records"], ref["records"]):
        assert abs(g["loss"] - e["loss"]) <= 1e-2 * abs(e["loss"]), (g["loss"], e["loss"])
    assert got[0]["records"][-1]["loss"] != ref["records"][-1]["loss"]   # it is lossy: it really quantised


def test_zeropp_step_runs_off_the_cpu():
    from parallel3d.mesh import MeshSpec, ParallelContext

    cfg = make_config(["parallel.zero=3", "parallel.zero_quantized_weights=true", "parallel.zero_hpz=true",
                       "parallel.zero_quantized_gradients=true", "parallel.gpus_per_node=4", "parallel.tp=2",
                       "train.precision=bf16"], 8)
    p = cfg.parallel
    ctx = ParallelContext.simulated(MeshSpec(tp=p.tp, dp=p.dp, gpus_per_node=4), 3, "meta")
    out = build_trainer(cfg, ctx).train_step()
    assert {"dp_cp.all_gather", "dp_node.all_gather", "dp_cp.all_to_all"} <= set(out["comm_bytes"])


def test_bad_zeropp_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="zero_quantized_weights is a ZeRO\\+\\+ option of ZeRO-3"):
        make_config(["parallel.zero=2", "parallel.zero_quantized_weights=true"], 2)
    with pytest.raises(ConfigError, match="gpus_per_node=4 splits"):
        make_config(["parallel.zero=3", "parallel.zero_hpz=true", "parallel.gpus_per_node=4", "parallel.dp=6",
                     "train.global_batch_size=6"], 6)
    with pytest.raises(ConfigError, match="quant_block"):
        make_config(["parallel.zero=3", "parallel.quant_block=0"], 2)
