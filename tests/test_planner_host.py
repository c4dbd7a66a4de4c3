"""The planner's host term for GPUs (cost.queue_seconds): the device runs its queue behind the host, so a
step of many small ops costs the host's issue time, one of few large ops the device's."""
from __future__ import annotations

import dataclasses

import pytest

from ckpt_helpers import make_config
from parallel3d.planner.cost import queue_seconds
from parallel3d.planner.dryrun import run_role
from parallel3d.planner.hardware import gpu
from test_planner import _stage_builder


def test_queue_is_the_device_sum_when_kernels_outlast_their_issue():
    assert queue_seconds([5.0, 5.0, 5.0], 1.0) == pytest.approx(1.0 + 15.0)


def test_queue_is_the_host_when_kernels_are_shorter_than_their_issue():
    assert queue_seconds([0.1] * 10, 1.0) == pytest.approx(10 * 1.0 + 0.1)


def test_queue_takes_each_stall_where_it_happens():
    """A long kernel lets the host run ahead; the short ones after it drain the lead, then wait for it."""
    # issue at 1, 2, 3, 4: the 10 s kernel ends at 11, then the three short ones run back to back
    assert queue_seconds([10.0, 0.5, 0.5, 0.5], 1.0) == pytest.approx(12.5)
    # short ones first: each waits for its issue (1.5, 2.5, 3.5), the long one starts at 4
    assert queue_seconds([0.5, 0.5, 0.5, 10.0], 1.0) == pytest.approx(14.0)


def _run(host_op_s: float, hidden: int):
    cfg = make_config([f"model.hidden_size={hidden}", "model.num_heads=4", "model.num_kv_heads=4",
                       f"model.ffn_hidden_size={2 * hidden}", "model.num_layers=2", "model.vocab_size=256",
                       "train.seq_len=64", "model.max_seq_len=64", "train.global_batch_size=4",
                       "train.micro_batch_size=2", "train.precision=bf16"], 1)
    return run_role(cfg, 0, _stage_builder, dataclasses.replace(gpu("h100"), host_op_s=host_op_s,
                                                              host_step_op_s=host_op_s), 8)


def test_a_small_model_on_a_gpu_is_priced_at_the_host_issue_rate():
    """Every action of a tiny model is host-bound: it lasts (its ops) x host_op_s, while without the host term
    it would be its kernels' microseconds. The stall is reported beside the compute it is part of."""
    host, free = _run(40e-6, 64), _run(0.0, 64)
    assert free.actions.keys() == host.actions.keys()
    for key, action in host.actions.items():
        device = free.actions[key].compute_s
        assert action.compute_s > 10 * device
        assert action.host_stall_s == pytest.approx(action.compute_s - device)
    ops = sum(count for count, _ in host.op_seconds.values())
    assert sum(a.ops for a in host.actions.values()) * 2 + host.outside.ops == ops
    step = sum(a.compute_s for a in host.actions.values()) * 2 + host.outside.compute_s  # 2 microbatches
    assert step == pytest.approx(ops * 40e-6, rel=0.05)


def test_without_a_host_term_the_action_is_the_sum_of_its_ops():
    run = _run(0.0, 64)
    assert all(a.host_stall_s == 0.0 for a in run.actions.values())
    total = sum(seconds for _, seconds in run.op_seconds.values())
    assert sum(a.compute_s for a in run.actions.values()) * 2 + run.outside.compute_s == pytest.approx(total)


def test_plan_cli_says_when_the_host_sets_the_pace():
    from test_planner import _plan_cli
    out = _plan_cli("--config", "configs/tiny.yaml", "--world-size", "1", "--gpu", "h100", "parallel.tp=1")
    assert out.returncode == 0, out.stderr
    assert "waits for the host" in out.stdout


def test_a_cpu_plan_runs_the_cpus_adamw_blocks():
    """A CPU run updates in cache-sized blocks of about 7 ops each, a GPU in 16M-element ones. Planning a CPU
    run, the stand-in takes the CPU's blocks (host_kernels.as_run_on_cpu asks adamw.block_for), so the plan
    counts the optimizer ops the real CPU step runs: once it counted 8 blocks where the run had 838."""
    from ckpt_helpers import build_trainer
    from parallel3d.data_parallel.adamw import BLOCK
    from parallel3d.mesh import ParallelContext
    from parallel3d.planner.dryrun import tracked_step
    from parallel3d.planner.host_kernels import as_run_on_cpu

    cfg = make_config(["parallel.tp=1", "model.hidden_size=128", "model.ffn_hidden_size=256",
                       "model.vocab_size=2048", "parallel.bucket_size=400000"], 1)
    planned_cfg = as_run_on_cpu(cfg)
    assert cfg.train.adamw_block == 0 and planned_cfg.train.adamw_block == BLOCK
    planned = run_role(planned_cfg, 0, _stage_builder, gpu("h100"), 8).op_seconds["lerp_"][0]
    _, tracker = tracked_step(build_trainer(cfg, ParallelContext.single()), "cpu")
    real = sum(op.name == "lerp_" for op in tracker.ops)
    assert planned == real > 2   # more blocks than buckets: the CPU's block size, not the GPU's
    gpu_plan = run_role(cfg, 0, _stage_builder, gpu("h100"), 8).op_seconds["lerp_"][0]
    assert gpu_plan < real


def test_adamw_block_refuses_a_negative_size():
    with pytest.raises(ValueError, match="train.adamw_block must be 0"):
        make_config(["train.adamw_block=-1"], 1)
