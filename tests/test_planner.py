"""The planner (issue 15): the dry run's memory and bytes against the same real step, the ZeRO formulas,
the cost model's arithmetic, and launch/plan.py.

The real step runs on gloo CPU ranks under the same StepTracker as the dry run on the `meta` stand-in, so
the comparison is like for like: what the planner reports is what the code allocates. (The layouts use
as many KV heads as heads: with GQA, CPU SDPA falls back to the math path and keeps the scores, which the
GPU path, and so the dry run, never does.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_helpers import build_trainer, make_config
from parallel3d.mesh import MeshSpec
from parallel3d.planner.cost import collective_time, link, op_time
from parallel3d.planner.dryrun import run_role, tracked_step
from parallel3d.planner.estimate import plan
from parallel3d.planner.hardware import gpu
from test_zero_memory import FORMULA

ROOT = Path(__file__).resolve().parents[1]
H100 = gpu("h100")
LAYOUTS = {
    "tp2-sp-zero1": ["parallel.tp=2", "parallel.sp=true", "parallel.zero=1"],
    "pp2-zero2": ["parallel.pp=2", "parallel.zero=2", "parallel.tp=1"],
    "dp2-zero3": ["parallel.zero=3", "parallel.tp=1"],
    "zero3-qwz-qgz": ["parallel.zero=3", "parallel.tp=1", "parallel.zero_quantized_weights=true",
                      "parallel.zero_quantized_gradients=true"],
    "zero1-powersgd": ["parallel.zero=1", "parallel.tp=1", "parallel.grad_compression=powersgd",
                       "parallel.compression_start_step=0"],
}
SMALL = ["model.hidden_size=64", "model.num_kv_heads=4", "model.ffn_hidden_size=128", "train.seq_len=64", "model.num_layers=4",
         "train.global_batch_size=8"]



def _real_memory(w, overrides):
    torch.set_num_threads(1)
    cfg = make_config(overrides, w.world_size)
    p = cfg.parallel
    trainer = build_trainer(cfg, w.context(MeshSpec.of(p)))
    # the dry run stands for NCCL, where each reduction's follow-ups (freeing its buffer) are queued right
    # after it (data_parallel/sync.py); gloo's would wait for is_completed() polls, whose timing varies
    trainer.optimizer.grads.follow.ordered = True
    out, tracker = tracked_step(trainer, "cpu")
    peak, split = tracker.peak()
    return peak, split, tracker.live(), out["comm_bytes"]


def _stage_builder(cfg, ctx):
    def build(layers, pre, post):
        from parallel3d.models.llama import Llama
        from parallel3d.models.moe import MoETransformer
        cls = MoETransformer if cfg.model.num_experts else Llama
        return cls(cfg.model, ctx, layers=layers, pre=pre, post=post, sequence_parallel=cfg.parallel.sp,
                   cp_mode=cfg.parallel.cp_mode, recompute=cfg.train.activation_checkpointing)
    return build


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dry_run_memory_and_bytes_equal_the_real_step(worlds, name):
    overrides = [*LAYOUTS[name], *SMALL]
    real = worlds.run(2, _real_memory, overrides)
    cfg = make_config(overrides, 2)
    for rank in range(2):
        run = run_role(cfg, rank, _stage_builder, H100, 8)
        peak, split, live, comm = real[rank]
        assert run.comm_bytes == comm, (rank, run.comm_bytes, comm)
        for k in ("params", "grads", "optimizer"):
            assert run.model_state[k] == live[k], (rank, k, run.model_state, live)
        assert abs(run.memory["peak"] - peak) <= 0.05 * peak, (rank, run.memory, peak, split)
        # gradients at the peak exactly (the buffers ZeRO-2/3 free inside the step are gradients too);
        # the activations within 5% of the peak: when gloo frees a sent activation differs from the
        # simulated backend by a few pipeline buffers (pp2-zero2: 110-143 kB, which was 7-8% of the
        # activations while ZeRO-2's gradient buffers were counted among them)
        assert run.memory["grads"] == split["grads"], (rank, run.memory, split)
        assert abs(run.memory["activations"] - split["activations"]) <= 0.05 * peak, (rank, run.memory, split)


def _comm_buffers(tracker) -> list[int]:
    return sorted(a.nbytes for a in tracker.allocs if a.category == "comm_buffers")


def _real_comm_buffers(w, overrides):
    torch.set_num_threads(1)
    cfg = make_config(overrides, w.world_size)
    p = cfg.parallel
    trainer = build_trainer(cfg, w.context(MeshSpec(tp=p.tp, dp=p.dp, pp=p.pp)))
    return _comm_buffers(tracked_step(trainer, "cpu")[1])


@pytest.mark.parametrize("name", ["tp2-sp-zero1", "dp2-zero3"])
def test_a_plan_of_a_cpu_run_allocates_what_gloo_collectives_allocate(worlds, name):
    """On gloo a reduce-scatter receives every rank's copy of its segment (comm/gloo.py): a buffer the
    size of its input, per bucket and per sequence-parallel exit. A dry run standing for gloo (a plan of a
    CPU run) allocates the same communication buffers as the real gloo step; one standing for NCCL does not."""
    import dataclasses

    from parallel3d.planner import dryrun

    overrides = [*LAYOUTS[name], *SMALL]
    real = worlds.run(2, _real_comm_buffers, overrides)
    cfg = make_config(overrides, 2)
    seen = {}
    tracked = dryrun.tracked_step

    def keep(trainer, device_type, signatures=False):
        out, tracker = tracked(trainer, device_type, signatures)
        seen["buffers"] = _comm_buffers(tracker)
        return out, tracker
    dryrun.tracked_step = keep
    try:
        for rank in range(2):
            run_role(cfg, rank, _stage_builder, dataclasses.replace(H100, runs_cpu_kernels=True), 8)
            assert seen["buffers"] == real[rank] and real[rank], (rank, seen["buffers"], real[rank])
            run_role(cfg, rank, _stage_builder, H100, 8)
            assert len(seen["buffers"]) < len(real[rank]), rank
    finally:
        dryrun.tracked_step = tracked


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_dry_run_model_state_follows_the_zero_formulas(zero):
    """bf16 params, fp32 main grads (4 bytes), fp32 master + m + v, N = 4 DP ranks (docs/parallelism.md, the ZeRO table)."""
    n = 4
    cfg = make_config([f"parallel.zero={zero}", "train.precision=bf16", "model.hidden_size=128",
                       "model.ffn_hidden_size=256", "model.vocab_size=512"], n)
    run = run_role(cfg, 0, _stage_builder, H100, 8)
    n_params = sum(v for v in [_count_params(cfg)])
    want = [f(n) if callable(f) else f for f in FORMULA[4][zero]]
    got = [run.model_state[k] / n_params for k in ("params", "grads", "optimizer")]
    for g, e in zip(got, want):
        assert abs(g - e) <= 0.05 * e, (zero, got, want)


def _count_params(cfg) -> int:
    from parallel3d.training.metrics import total_params
    return total_params(cfg.model)


def test_cost_model_arithmetic():
    # a 1 TFLOP matmul in bf16 on an H100: compute-bound at 75% of 989 TFLOP/s
    assert op_time(1e12, 1e6, 989e12, H100) == pytest.approx(1e12 / (989e12 * 0.75))
    # a 1 GB copy is bandwidth-bound at 85% of 3.35 TB/s
    assert op_time(0, 1e9, 989e12, H100) == pytest.approx(1e9 / (3.35e12 * 0.85))
    alpha, beta = link([0, 1, 2, 3], 8, H100)
    assert (alpha, beta) == (10e-6, 450e9 * 0.8)              # one node: NVLink
    assert link([0, 8], 8, H100) == (20e-6, 50e9 * 0.9)       # two nodes: the network
    # a ring over 2 nodes of 8 crosses the network twice per round and NVLink 14 times
    assert link(list(range(16)), 8, H100) == (pytest.approx((2 * 20e-6 + 14 * 10e-6) / 16), 50e9 * 0.9)
    assert collective_time("all_reduce", 1e9, 4, alpha, beta) == pytest.approx(6 * alpha + 1.5e9 / beta)
    assert collective_time("all_gather", 1e9, 4, alpha, beta) == pytest.approx(3 * alpha + 0.75e9 / beta)
    assert collective_time("all_reduce", 1e9, 1, alpha, beta) == 0.0


def test_a_collective_after_compute_pays_the_measured_wake_extra():
    """gloo on a shared CPU: a collective costs its (alpha, beta) plus the profile's extra after a long
    stretch of compute, in proportion to the rank's modeled compute since its last collective
    (cost.wake_seconds); a GPU (nothing measured) nothing. Collectives started beside compute pay it too
    (test_planner_overlap)."""
    import dataclasses

    from parallel3d.planner.cost import wake_seconds

    cpu = dataclasses.replace(H100, comm_wake_s={"all_reduce": 2e-3, "send": 1e-3}, comm_wake_gap_s=4e-3)
    assert wake_seconds("all_reduce", 1e-3, cpu) == pytest.approx(0.5e-3)
    assert wake_seconds("all_reduce", 9e-3, cpu) == pytest.approx(2e-3)     # saturates at the probe's gap
    assert wake_seconds("recv", 8e-3, cpu) == pytest.approx(1e-3)           # a receive is priced as a send
    assert wake_seconds("all_to_all", 8e-3, cpu) == 0.0 and wake_seconds("all_reduce", 1.0, H100) == 0.0
    # the dry run: every blocking TP all-reduce of a tp2 step is preceded by more than a nanosecond of compute
    cfg = make_config(["parallel.tp=2", "parallel.sp=false", "parallel.zero=0", *SMALL], 2)
    tiny_gap = dataclasses.replace(cpu, comm_wake_gap_s=1e-12)
    base, woken = (run_role(cfg, 0, _stage_builder, g, 8).comm_s for g in (H100, tiny_gap))
    calls = (woken["tp.all_reduce"] - base["tp.all_reduce"]) / 2e-3
    assert calls == pytest.approx(round(calls)) and round(calls) >= 4 * 2 * 2   # layers x (attn, mlp) x (F, B)


def test_plan_reports_every_pipeline_stage():
    cfg = make_config(["parallel.pp=2", "parallel.tp=1", "parallel.zero=1", *SMALL], 4)
    result = plan(cfg, _stage_builder, H100, 8)
    assert result.fits and result.step_time_s > 0 and 0 < result.mfu < 1
    assert [r["pp_rank"] for r in result.roles] == [0, 1]
    assert result.memory["peak"] == max(r["memory"]["peak"] for r in result.roles)
    assert {"pp.send", "pp.recv"} & set(result.comm_bytes)


def _plan_cli(*args):
    return subprocess.run([sys.executable, "launch/plan.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def _plan_main(capsys, *args) -> tuple[int, str]:
    """launch/plan.py's main in this process: (exit code, stderr). The error paths end in common.fail before
    any dry run, as they do under `python launch/plan.py` (the subprocess cases above and below)."""
    from launch import plan as plan_cli

    with pytest.raises(SystemExit) as end:
        plan_cli.main(list(args))
    return end.value.code, capsys.readouterr().err


def test_plan_cli_json_and_errors(capsys):
    proc = _plan_cli("--config", "configs/tiny.yaml", "--world-size", "8", "parallel.tp=2", "parallel.pp=2",
                     "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["layout"]["tp"] == 2 and out["layout"]["pp"] == 2 and out["layout"]["dp"] == 2
    assert set(out["memory"]) == {"params", "grads", "optimizer", "activations", "comm_buffers", "peak"}
    assert out["fits"] is True and out["tokens_per_s"] > 0
    bad = _plan_cli("--config", "configs/tiny.yaml", "--world-size", "6", "parallel.tp=4")
    assert bad.returncode == 2 and bad.stderr.startswith("error:") and "Traceback" not in bad.stderr
    code, err = _plan_main(capsys, "--config", "configs/tiny.yaml", "--world-size", "4", "--gpu", "z80")
    assert code == 2 and "unknown GPU 'z80'" in err
    code, err = _plan_main(capsys, "--config", "configs/tiny.yaml", "--world-size", "4", "--gpus-per-node", "0")
    assert code == 2 and "gpus_per_node must be a positive integer" in err
    # --search with a world no layout can take says why, instead of printing an empty list
    code, err = _plan_main(capsys, "--config", "configs/tiny.yaml", "--world-size", "7", "--search")
    assert code == 2 and "no valid layout for world size 7" in err
    assert "the most common reason: " in err and "Traceback" not in err


def test_search_picks_a_fitting_layout():
    proc = _plan_cli("--config", "configs/tiny.yaml", "--world-size", "4", "--search", "--json",
                     "--max-candidates", "6")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plans = json.loads(proc.stdout.strip().splitlines()[-1])
    assert plans and all(p["fits"] for p in plans)
    assert [p["tokens_per_s"] for p in plans] == sorted((p["tokens_per_s"] for p in plans), reverse=True)
    world = {p["layout"]["tp"] * p["layout"]["pp"] * p["layout"]["cp"] * p["layout"]["dp"] for p in plans}
    assert world == {4}


def test_a_cpu_tensor_in_a_collective_fails_the_dry_run_naming_rank_and_op():
    """A model that hands a host tensor to a TP collective (NCCL would fail): the dry run says where."""
    from parallel3d import comm
    from parallel3d.planner.dryrun import DryRunError

    def broken_builder(cfg, ctx):
        build = _stage_builder(cfg, ctx)

        def stage(layers, pre, post):
            module = build(layers, pre, post)
            forward = module.forward

            def leaky(*args, **kwargs):
                comm.all_reduce(torch.ones(2), ctx.tp)  # a CPU tensor: the bug under test
                return forward(*args, **kwargs)
            module.forward = leaky
            return module
        return stage

    cfg = make_config(["parallel.tp=2", *SMALL], 2)
    with pytest.raises(DryRunError, match=r"rank 1 .*all_reduce on tp group .* is on cpu, the group's device is meta"):
        run_role(cfg, 1, broken_builder, H100, 8)


def test_kernel_occupancy_derates_the_roofline(monkeypatch):
    """The kernel report's table is what the planner reads; a kernel with few resident warps is slowed."""
    from parallel3d.planner import kernels

    factor, warps = kernels.occupancy_factor("H100-SXM5-80GB", "flash_attention_fwd",
                                             "torch.bfloat16", 128, True)
    table = kernels._table()["90"]["_attn_fwd_kernel"]["bf16 d=128 causal"]
    assert warps == {"_attn_fwd_kernel": table["ctas_per_sm"] * table["num_warps"]}
    assert factor == min(1.0, warps["_attn_fwd_kernel"] / 8)
    low = {"90": {"_attn_fwd_kernel": {"bf16 d=128 causal": {"ctas_per_sm": 1, "num_warps": 4}}}}
    monkeypatch.setattr(kernels, "_table", lambda: low)
    factor, _ = kernels.occupancy_factor("H100-SXM5-80GB", "flash_attention_fwd",
                                         "torch.bfloat16", 96, True)  # d=96 runs the d=128 variant
    assert factor == 0.5
    assert op_time(1e12, 0, 989e12, H100, factor) == pytest.approx(2 * op_time(1e12, 0, 989e12, H100))
    assert kernels.occupancy_factor("H100-SXM5-80GB", "mm", "torch.bfloat16", 128, True) is None


def test_plan_moves_offloaded_state_off_the_device():
    """parallel.offload_optimizer / offload_params: the device peak drops by exactly the measured optimizer
    state, ZeRO-3 shard and the gradients beyond the buckets in flight, and the step pays PCIe and
    host-AdamW time for it."""
    base = ["parallel.zero=3", "parallel.tp=1", "train.precision=bf16", *SMALL]
    plain = plan(make_config(base, 2), _stage_builder, H100, 8)
    both = plan(make_config([*base, "parallel.offload_optimizer=cpu", "parallel.offload_params=cpu"], 2),
                _stage_builder, H100, 8)
    assert plain.memory["optimizer"] > 0 and both.memory["optimizer"] == 0
    n_params = _count_params(make_config(base, 2))
    shard = plain.memory["params"] - both.memory["params"]
    assert abs(shard - 2 * n_params / 2) <= 0.05 * n_params     # the bf16 ZeRO-3 shard of 2 ranks
    moved = plain.memory["optimizer"] + shard
    off = both.breakdown["offload"]
    # the gradients leave too, bucket by bucket: the device keeps the buckets in flight
    assert 0 < off["grads_in_flight"] == both.memory["grads"]
    assert plain.memory["peak"] - both.memory["peak"] == moved + off["grads_at_peak"] - off["grads_in_flight"]
    assert off["host_bytes"] == moved + off["host_grads"] and off["host_grads"] > 0
    assert both.step_time_s > plain.step_time_s
    assert both.layout["offload_optimizer"] == "cpu" and both.layout["offload_params"] == "cpu"


@pytest.mark.parametrize("schedule", ["zb-v", "dualpipe-v", "interleaved"])
def test_plan_runs_the_multi_chunk_schedules(schedule):
    v = "parallel.virtual_stages=2"
    cfg = make_config(["parallel.pp=2", "parallel.tp=1", f"parallel.schedule={schedule}", v, *SMALL], 2)
    result = plan(cfg, _stage_builder, H100, 8)
    assert result.fits and result.step_time_s > 0 and len(result.roles) == 2
    assert result.layout["schedule"] == schedule


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_dry_run_flops_follow_the_model_formula(moe):
    """The FLOPs the dry run counts op by op equal 6N + attention per token (docs/planner.md; MoE: active
    parameters) within 5%: causal attention is counted at half of 12Lhs, the rest is the matmuls."""
    from parallel3d.training.metrics import flops_per_token

    extra = ["model.num_experts=8", "model.moe_top_k=2", "model.moe_ffn_hidden_size=256"] if moe else []
    cfg = make_config(["model.hidden_size=256", "model.ffn_hidden_size=512", "model.vocab_size=512",
                       "train.seq_len=128", "model.num_heads=4", "model.num_kv_heads=4", *extra], 1)
    run = run_role(cfg, 0, _stage_builder, H100, 8)
    want = flops_per_token(cfg.model, 128) * cfg.train.global_batch_size * 128
    assert 0.95 * want <= run.flops <= want, (run.flops, want)


def test_offload_copies_hide_behind_the_compute_beside_them():
    """The code overlaps each gradient bucket's copy down with the last backward and each parameter bucket's
    copy up with the next forward (offload/streams.py); the plan exposes only what exceeds that compute,
    at least one bucket each way, and the host step in full."""
    from parallel3d.planner.offload import exposed_offload
    moved = {"offload_s": 7.0, "grads_down_s": 4.0, "params_up_s": 2.0, "host_s": 1.0, "bucket_copy_s": 0.1,
             "param_fetch_s": 0.0}
    assert exposed_offload(moved, 0.0, 0.0, 0.0) == pytest.approx(7.0)          # nothing to hide behind
    assert exposed_offload(moved, 3.0, 1.5, 10.0) == pytest.approx(1.0 + 0.5 + 1.0)
    assert exposed_offload(moved, 9.0, 9.0, 10.0) == pytest.approx(0.1 + 0.1 + 1.0)  # one bucket each way
    moved.update(offload_s=0.0, host_s=0.0, param_fetch_s=3.0)   # parameters offloaded, optimizer kept
    assert exposed_offload(moved, 0.0, 0.0, 2.0) == pytest.approx(1.0)
    assert exposed_offload({**moved, "param_fetch_s": 0.0}, 0.0, 0.0, 0.0) == 0.0


def test_plan_runs_activation_offload_and_prices_its_copies():
    """train.activation_offload runs in the dry run itself (on the stand-in the hooks drop each saved tensor
    and allocate it again at unpack): the device activations drop, the saved bytes of every microbatch in
    flight sit in host memory, and the step pays for the copies that its compute does not hide."""
    from parallel3d.planner.offload import exposed_activation_copies

    base = ["parallel.pp=2", "parallel.tp=1", "train.precision=bf16", *SMALL, "train.seq_len=256",
            "model.max_seq_len=256", "model.num_layers=8"]  # saved tensors above min_bytes, 4 blocks a stage
    plain = plan(make_config(base, 2), _stage_builder, H100, 8)
    off = plan(make_config([*base, "train.activation_offload=true"], 2), _stage_builder, H100, 8)
    assert off.memory["activations"] < 0.55 * plain.memory["activations"]  # 0.50: 2 of 4 blocks, fetched together
    assert off.memory["peak"] < plain.memory["peak"]
    moved = off.breakdown["offload"]
    assert moved["host_bytes"] > plain.memory["activations"] // 4 and "activations_s" in moved
    assert off.step_time_s >= plain.step_time_s
    assert exposed_activation_copies(int(H100.pcie_bytes_per_s * 0.8), 0.25, 2.0, H100) == pytest.approx(0.75)


def test_planning_a_cpu_run_dry_runs_the_cpu_kernels(monkeypatch):
    """Planning for a CPU (`--gpu cpu`), the stand-in takes the kernels `auto` picks on a CPU (torch twins,
    aten's CPU flash attention in bands, the expert loop), not a GPU's Triton ops: a CPU run launches several
    times as many ops, and each costs the host's per-op overhead there. The model FLOPs stay the same."""
    import dataclasses

    import parallel3d.planner.estimate as estimate
    from parallel3d.planner.host_kernels import CPU_FLASH_BWD, CPU_FLASH_FWD, as_run_on_cpu

    cfg = make_config(["model.kernels=auto", "train.seq_len=160", "model.max_seq_len=160"], 1)
    gpu_run = run_role(cfg, 0, _stage_builder, H100, 8)
    cpu_run = run_role(as_run_on_cpu(cfg), 0, _stage_builder, H100, 8)
    # a GPU's attention without the lse: SDPA's kernel, through its stand-in op (kernels/attention_standin.py)
    assert "library_attention_fwd" in gpu_run.op_seconds and "rmsnorm_fwd" in gpu_run.op_seconds
    assert {CPU_FLASH_FWD, CPU_FLASH_BWD} <= set(cpu_run.op_seconds)
    assert not {"library_attention_fwd", "flash_attention_fwd", "rmsnorm_fwd", "swiglu"} & set(cpu_run.op_seconds)
    ops = [sum(n for n, _ in run.op_seconds.values()) for run in (gpu_run, cpu_run)]
    assert ops[1] > 1.5 * ops[0]   # 1,545 against 789 ops here
    assert cpu_run.flops == pytest.approx(gpu_run.flops, rel=1e-12)   # causal bands count the visible pairs

    seen = []
    real = estimate.run_role

    def spy(c, *args, **kwargs):
        seen.append((c.model.kernels, c.model.attention))
        return real(c, *args, **kwargs)
    monkeypatch.setattr(estimate, "run_role", spy)
    plan(cfg, _stage_builder, dataclasses.replace(H100, runs_cpu_kernels=True), 8)
    plan(cfg, _stage_builder, H100, 8)
    assert seen == [("torch", "sdpa"), ("auto", "auto")]


def test_bucketed_gradient_reduction_waits_for_its_buckets():
    """A bucket's reduction starts once backward has produced it and after the previous one (one link):
    one bucket hides nothing, the last bucket always follows the backward, many small ones hide the rest."""
    from parallel3d.planner.cost import exposed_buckets

    assert exposed_buckets([4.0], 10.0) == pytest.approx(4.0)             # ready only when backward ends
    assert exposed_buckets([1.0] * 4, 10.0) == pytest.approx(1.0)         # the last bucket's reduction
    assert exposed_buckets([2.0] * 4, 4.0) == pytest.approx(5.0)          # the link is the bottleneck
    assert exposed_buckets([1.0, 3.0], 8.0) == pytest.approx(3.0)         # bucket 2 ready at the end
    assert exposed_buckets([1.0] * 4, 0.0) == pytest.approx(4.0)          # no overlap at all
    assert exposed_buckets([], 5.0) == 0.0


def test_plan_prices_one_bucket_as_unhidden_and_small_buckets_as_hidden(monkeypatch):
    """Through plan(): with one gradient bucket its whole reduction follows the backward (it used to be
    priced as hidden behind it); with many small buckets (parallel.bucket_size) only about the last one's."""
    import parallel3d.planner.estimate as estimate

    calls = []
    real = estimate.exposed_buckets

    def spy(parts, backward):
        calls.append((list(parts), backward, real(parts, backward)))
        return calls[-1][2]
    monkeypatch.setattr(estimate, "exposed_buckets", spy)
    for size in (0, 1_000_000):   # one 40M bucket; 15 of 1M
        cfg = make_config(["parallel.zero=1", f"parallel.bucket_size={size}", "model.hidden_size=1024",
                           "model.num_heads=8", "model.num_kv_heads=8", "model.ffn_hidden_size=2816",
                           "model.num_layers=2", "train.seq_len=256", "model.max_seq_len=256"], 2)
        calls.clear()
        plan(cfg, _stage_builder, H100, 8)
        parts, backward, exposed = max(calls, key=lambda c: c[2])
        assert 0 < sum(parts) < backward   # the old rule hid all of it
        if size == 0:
            assert len(parts) == 1 and exposed == pytest.approx(sum(parts))
        else:
            assert len(parts) > 10 and 0 < exposed < 0.25 * sum(parts)


def test_a_stage_runs_at_its_slowest_ranks_pace():
    """ZeRO-0 over dp2: DP rank 0 norms the gradients every replica holds (data_parallel/clip.py), rank 1
    does not, so rank 0's tail is longer. The plan's tail is the slower one's: it used to take the last
    rank's alone for a single stage, and the step waited for rank 0 unpriced."""
    cfg = make_config(["parallel.zero=0", "parallel.tp=1", *SMALL], 2)
    cache: dict = {}
    result = plan(cfg, _stage_builder, H100, 8, cache=cache)
    tails = {run.rank: run.outside.time_s for run in cache.values()}
    assert set(tails) == {0, 1} and tails[0] > tails[1]
    assert result.breakdown["outside_actions_s"] >= tails[0]


def test_a_stages_memory_is_its_fullest_ranks():
    """tp2 at world 2 with a vocabulary of 1001: rank 0 holds 501 real vocabulary columns, rank 1 500 and
    a padding one (tensor_parallel/layers.py), so rank 0's loss keeps more and its peak is the larger. The
    plan's peak is rank 0's: it used to take the last rank's alone for a single stage, so a layout could
    be planned to fit while rank 0 ran out of memory."""
    cfg = make_config(["parallel.tp=2", *SMALL, "model.vocab_size=1001"], 2)
    cache: dict = {}
    result = plan(cfg, _stage_builder, H100, 8, cache=cache)
    peaks = {run.rank: run.memory["peak"] for run in cache.values()}
    assert set(peaks) == {0, 1} and peaks[0] > peaks[1]
    assert result.memory["peak"] == peaks[0] and result.roles[0]["rank"] == 0


def test_a_compiled_run_is_planned_as_its_eager_step_and_says_so(monkeypatch):
    """train.compile=true: the stand-in steps the eager blocks (never compiling one), the figures are the
    eager plan's, and the plan carries the note plan.py prints (the fusion is not modelled)."""
    from launch import plan as plan_cli
    from launch.common import stage_builder
    from parallel3d.planner.assumptions import COMPILE_NOTE

    base = ["parallel.tp=2", *SMALL]
    eager = plan(make_config(base, 2), stage_builder, H100, 8)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda *a, **k: pytest.fail("a block compiled on the stand-in"))
    compiled = plan(make_config([*base, "train.compile=true"], 2), stage_builder, H100, 8)
    assert (compiled.step_time_s, compiled.memory, compiled.comm_bytes) == \
        (eager.step_time_s, eager.memory, eager.comm_bytes)
    assert eager.notes == [] and compiled.notes == [COMPILE_NOTE] == compiled.to_json()["notes"]
    assert f"note: {COMPILE_NOTE}" in plan_cli._table(compiled, H100, 2).splitlines()


def test_a_plans_notes_name_each_simplification_the_config_meets():
    """Plan.notes (plan.py's note: lines) for packed documents and for a dropless MoE planned balanced; none
    for a plan that meets neither, for a routing load given, a capacity factor or one EP rank."""
    from parallel3d.planner.assumptions import DOCUMENTS_NOTE, ROUTING_NOTE, notes

    moe = ["parallel.tp=1", "model.num_experts=4", "model.moe_top_k=2"]
    assert notes(make_config(SMALL, 2), 1.0) == []
    assert notes(make_config([*SMALL, "data.document_masking=true", "data.eos_id=0"], 2), 1.0) == [DOCUMENTS_NOTE]
    assert notes(make_config([*SMALL, *moe, "parallel.ep=2"], 2), 1.0) == [ROUTING_NOTE]
    assert notes(make_config([*SMALL, *moe, "parallel.ep=2"], 2), 1.4) == []
    assert notes(make_config([*SMALL, *moe, "parallel.ep=2", "model.capacity_factor=1.25"], 2), 1.0) == []
    assert notes(make_config([*SMALL, *moe, "parallel.ep=1"], 2), 1.0) == []
    # a GPU whose attention kernels were never measured says it prices them at the matmul's efficiency
    from parallel3d.planner.assumptions import attention_note
    assert notes(make_config(SMALL, 2), 1.0, gpu("a100")) == [attention_note(gpu("a100"))]
    assert "A100-SXM4-80GB" in attention_note(gpu("a100"))
    assert notes(make_config(SMALL, 2), 1.0, gpu("b200")) == [attention_note(gpu("b200"))]
    assert notes(make_config(SMALL, 2), 1.0, H100) == notes(make_config(SMALL, 2), 1.0, gpu("h200")) == []


def test_attention_is_priced_at_the_measured_rate_of_the_kernel_a_cuda_run_takes():
    """A CUDA run takes SDPA's kernels, whose stand-in ops the dry run records: without the lse (no CP,
    Ulysses) its attention, with it (ring CP blocks, which merge their lse) its cuDNN op; ours where that op
    cannot run (fp32). On Hopper each is priced at its measured share of the peak
    (hardware.HOPPER_ATTENTION, from the H200 tile sweep); the A100, where none was measured, keeps the
    matmul's efficiency with our kernel's occupancy derate."""
    from parallel3d.planner.hardware import HOPPER_ATTENTION

    def attention_ops(overrides, world):
        run = run_role(make_config([*SMALL, "model.kernels=auto", *overrides], world), 0, _stage_builder, H100, 8)
        return {k for k in run.op_seconds if k.endswith(("attention_fwd", "attention_bwd"))}

    library = {"library_attention_fwd", "library_attention_bwd"}
    library_lse = {"library_lse_attention_fwd", "library_lse_attention_bwd"}
    ours = {"flash_attention_fwd", "flash_attention_bwd"}
    assert attention_ops(["parallel.tp=1"], 1) == library
    assert attention_ops(["parallel.tp=1", "parallel.cp=2", "parallel.cp_mode=ulysses"], 2) == library
    ring = ["parallel.tp=1", "parallel.cp=2", "parallel.cp_mode=ring"]
    assert attention_ops([*ring, "train.precision=bf16"], 2) == library_lse
    assert attention_ops([*ring, "train.precision=fp32"], 2) == ours
    # model.kernels=torch: CUDA's ring blocks run the exact reference (the scores kept), and so does the stand-in
    assert attention_ops(["parallel.tp=1", "parallel.cp=2", "model.kernels=torch"], 2) == set()
    flops = 1e12
    for gpu_name in ("h100", "h200"):
        device = gpu(gpu_name)
        for name, share in HOPPER_ATTENTION.items():
            assert op_time(flops, 0.0, 989e12, device, 0.5, torch.bfloat16, name) == pytest.approx(
                flops / (989e12 * share))   # the occupancy argument is inside the measured share
    assert HOPPER_ATTENTION["library_attention_fwd"] > HOPPER_ATTENTION["library_lse_attention_fwd"] \
        > HOPPER_ATTENTION["flash_attention_fwd"]
    a100 = gpu("a100")
    assert op_time(flops, 0.0, 312e12, a100, 0.5, torch.bfloat16, "flash_attention_fwd") == pytest.approx(
        flops / (312e12 * 0.75 * 0.5))
