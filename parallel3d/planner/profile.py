"""This machine as a planner device (`launch/plan.py --gpu cpu`): short microbenchmarks, cached in a file.

A CPU run under torchrun gives each rank one thread (torchrun sets OMP_NUM_THREADS=1 and launch/common.py
divides the threads by the local world size), so every rate is measured on one thread:
  - matmul: seconds of the three GEMMs of a linear layer (forward, input and weight gradient, in the
    layouts autograd runs them) at 2n^3 FLOPs for n = 32..1024, per dtype (fp32, bf16); an op of F FLOPs
    is priced at the time of the measured GEMMs of the same FLOPs (log-log interpolation), since small
    matmuls on a CPU run far below the large-matmul rate;
  - memory bandwidth: an element-wise add (read two, write one) over working sets from cache-sized to
    memory-sized (`memory_hierarchy`);
  - attention: aten's CPU flash attention (the `sdpa` backend a CPU run uses, kernels/attention_backend.py)
    forward and backward, causal, at sequence lengths 64..512, against the FLOPs our flash ops declare:
    the dry run of a CPU run takes these very ops (planner/host_kernels.py) and prices them on these
    curves (the CPU kernel runs well below the matmul rate);
  - every op of a plan, replayed alone on tensors of its shapes (planner/op_replay.py, cached beside this
    profile): the time of the kernel the code runs, where the curves above only approximate it. Replayed,
    its inputs are hot in cache; in the step, an input last touched more than the cache ago (weights,
    optimizer state, activations saved for backward) comes from memory: `memory_hierarchy` measures the
    cache's size and what a byte from memory costs more, and the tracker each input's reuse distance;
  - per-op overhead: the project's own training step (the real Trainer, world 1) on a model so small that
    its arithmetic is negligible, less its ops' replayed times, divided by the ops the planner's tracker
    counts in it: what the host spends around each op on Python modules, autograd and hooks. On a CPU at
    the sizes we run this is a large part of a step (a GPU hides it behind its queue). Needs the stage
    builder the launch scripts use (the library does not import the models); without one, a bare
    nn.Sequential's forward + backward stands in (it underestimates: no hooks, no trainer);
  - the host's optimizer step under optimizer offload: the DistributedOptimizer's own step over host state
    (`host_step_rate`: unscale, norm, clipping, AdamW, the 16-bit publish copy) in params/s;
  - gloo: each collective as parallel3d.comm runs it (all-reduce, reduce-scatter, all-gather, all-to-all,
    batched send/recv), at 1 KiB and 4 MiB, each after a short matmul and averaged over calls as a step
    pays them (profile_gloo.py), on `world` spawned processes of one thread each, solved for the
    (alpha, beta) of cost.collective_time's formula; and at 1 KiB after 3 ms of matmul, whose extra
    (cost.wake_seconds) a collective, blocking or started, pays in proportion to the compute since the
    rank's last one;
  - the process's resident memory before any model exists (Python, torch, gloo): the CPU's analogue of the
    CUDA context, added to the planned peak so it compares with the run's peak RSS.
Ranks sharing the machine are priced as they run: with the gloo figures, `world` processes time a small
matmul, a per-op loop and a stream through memory all at once, and their slowdown against one process
alone (shared caches and memory bandwidth, vCPUs on one physical core) scales the matmul curves and the
replayed op times, the per-op overhead, and the cost of a byte from memory; ranks outnumbering the
cores also divide the rates by cores / world. The collectives are measured at that world size. gloo
moves data on its own threads, which overlap with the compute freely only where a core is left for them
(cores > world); otherwise a collective the code starts beside compute (CP ring, ZeRO-3 prefetch,
gradient reduction) takes a core from it for the share of its time its threads are busy, which the
profile measures at 4 MiB, and only the rest hides (cost.hidden_share).

Cache: $XDG_CACHE_HOME/parallel3d (default ~/.cache/parallel3d)/hardware-<host>-<cores>c.json, with the
gloo figures per world size, and the replayed op times beside it (ops-hardware-...); `--reprofile`
measures both again.
"""
from __future__ import annotations

import copy
import json
import os
import socket
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from parallel3d.planner import op_replay
from parallel3d.planner.hardware import GPU
from parallel3d.planner.profile_gloo import best, measure_gloo, median_seconds

MATMUL_SIZES = (32, 64, 128, 256, 512, 1024)
# 2: the per-op overhead is the host's time around the ops, their replayed kernels taken out (op_replay.py), and
# the memory hierarchy behind replayed ops (memory_hierarchy); 3: collectives timed as a step calls them;
# 4: and after a long stretch of compute (profile_gloo.WAKE_GAP_S); 5: every call but the slowest
# (profile_gloo.typical); 6: gloo's reduce-scatter without its sum on wait, which the dry run prices as an
# op; 7: the collectives' busy share (profile_gloo.BUSY_NOTE); 8: the per-op overhead from the median step,
# not the fastest, and 40 calls at 4 MiB (profile_gloo.LARGE_CALLS); 9: the memory hierarchy the median
# of three samples (measure_compute); 10: each collective timed in rounds over all of them, the median of the
# rounds (profile_gloo.ROUNDS), 80 calls a round at 1 KiB; 11: the per-op overhead net of the ops' times in
# the step's order (op_replay.replay_in_order), as the dry run prices them; 12: gloo's all-gather in place,
# without the copy of the rank's own block, which the dry run prices as an op (comm.gloo.own_block);
# 13: gloo's figures the median over three groups of processes (profile_gloo.GROUPS); 14: the per-op
# overhead net of the ops' times in order per action, as the dry run now prices them (op_replay.segments);
# 15: net of replays kept at one speed of the machine (replay_speed.py)
VERSION = 16
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def cache_path() -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "parallel3d"
    return root / f"hardware-{socket.gethostname()}-{cores()}c.json"


def measure_compute(builder: Optional[tuple] = None) -> dict:
    """Matmul and attention curves, bandwidth, per-op overhead and the offloaded optimizer step's rate, on one
    thread (seconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        curves = {}
        for key, dtype in DTYPES.items():
            rows = []
            for n in MATMUL_SIZES:
                rows.append([2.0 * n ** 3, _linear_gemms_seconds(n, dtype, 5 if n < 512 else 2)])
            curves[key] = rows
        # the hierarchy three times, spread over the profile, each figure the median: one sample had caught a
        # moment that gave half the bandwidth and half the cache of the minutes around it (see memory_hierarchy)
        samples = [memory_hierarchy()]
        host_step = host_step_rate()
        samples.append(memory_hierarchy())
        overhead = _step_overhead(*builder) if builder is not None else _op_overhead()
        attention = _attention_curves()
        samples.append(memory_hierarchy())
        hierarchy = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    finally:
        torch.set_num_threads(threads)
    return {"matmul": curves, "op_overhead_s": overhead, "host_step_params_per_s": host_step, "attention": attention,
            **hierarchy}


def memory_hierarchy() -> dict:
    """The cache a replayed op's inputs sit in and the memory behind it, from an add over working sets of
    1.5 MiB to 384 MiB (three tensors): `hot_bytes_per_s` at the smallest, `memory_bytes_per_s_cold` at the
    largest, `memory_bytes_per_s` (the device's one bandwidth, what the roofline falls back to) at 48 MiB,
    and `cache_bytes` the largest working set still at least halfway between the two in time per
    byte (a 4.7 MB bf16 weight read by a GEMM ran 1.14 ms cycled over 19 MB of copies and 1.43 ms over 300
    MB here, with the knee near 32 MB; the add's midpoint came out at 48 MiB). One call moves with the VM:
    a profile at 16:48 UTC on 2026-11-26 measured 9.2 GB/s at 48 MiB and a 24 MiB cache, four calls minutes
    later 23-27 GB/s and 48 MiB each (measure_compute takes the median of three)."""
    rates = {}
    for log2 in range(17, 26):
        n = 1 << log2
        x, y, out = (torch.full((n,), 1.0) for _ in range(3))   # not rand: 100M random numbers take seconds
        rates[3 * 4 * n] = 3 * 4 * n / best(lambda: torch.add(x, y, out=out), 20 if log2 < 22 else 3)
    hot, cold = rates[min(rates)], rates[max(rates)]
    halfway = 2 / (1 / hot + 1 / cold)
    cache = max((size for size, rate in rates.items() if rate >= halfway), default=min(rates))
    return {"hot_bytes_per_s": hot, "memory_bytes_per_s_cold": cold, "memory_bytes_per_s": rates[3 * 4 << 22],
            "cache_bytes": cache}


def host_step_rate(params: int = 1 << 25) -> float:
    """Parameters per second of the host's share of an optimizer step under `parallel.offload_optimizer=cpu`,
    on the calling thread(s): the DistributedOptimizer itself (world 1, bf16, its default buckets) over one
    linear of `params` weights with its state on the host, timed from `finish_grad_sync` through
    `clip_grad_norm` and `step`. That is every pass the code makes over the held gradient and the state: the
    unscale-and-check, the norm, the clipping (a threshold it always exceeds, as the dry run plans), AdamW
    (adamw_flat_) and the 16-bit copy each updated bucket publishes. The copies between device and host are
    not in it (planner/offload.py prices them on PCIe). 32M parameters (0.5 GiB of fp32 state and gradient):
    far larger than any cache, as an offloaded model's state is (64M gave the same rate here in twice the
    time). On the project's CPU machine the step ran at 126-150 M params/s where AdamW alone ran at 230; on
    the H200's host, pricing AdamW alone left the offloaded step 1.7x its plan."""
    from torch import nn

    from parallel3d.data_parallel.config import DataParallelConfig
    from parallel3d.data_parallel.optimizer import DistributedOptimizer
    from parallel3d.mesh import ParallelContext

    side = int(round(params ** 0.5))
    model = nn.Linear(side, side, bias=False).to(torch.bfloat16)
    opt = DistributedOptimizer([model], ParallelContext.single(torch.device("cpu")),
                               DataParallelConfig(precision="bf16", offload_optimizer="cpu"))
    x = torch.ones(1, side, dtype=torch.bfloat16)
    times = []
    for _ in range(3):   # the first pages the state in
        opt.zero_grad()
        opt.set_last_microbatch(True)
        opt.scale_loss(model(x).float().sum()).backward()
        t0 = time.perf_counter()
        opt.finish_grad_sync()
        opt.clip_grad_norm(1e-6)
        opt.step(1e-4)
        times.append(time.perf_counter() - t0)
    opt.close()
    return side * side / min(times[1:])


def _linear_gemms_seconds(n: int, dtype: torch.dtype, repeats: int) -> float:
    """Mean seconds of the three GEMMs of a linear layer of 2n^3 FLOPs each, in the layouts autograd runs
    them: tokens (n/2, n) @ weight (2n, n).T, its input gradient (n/2, 2n) @ (2n, n) and its weight
    gradient (2n, n/2) @ (n/2, n). A square matmul of the same FLOPs ran 1.4-1.6x faster than these in
    bf16 on this CPU, so square curves priced a model's linears too low."""
    x, w, dy = (torch.randn(*shape).to(dtype) for shape in ((n // 2, n), (2 * n, n), (n // 2, 2 * n)))
    return (best(lambda: torch.nn.functional.linear(x, w), repeats) + best(lambda: dy @ w, repeats)
            + best(lambda: dy.t() @ x, repeats)) / 3


def _attention_curves() -> dict:
    """(FLOPs as kernels/ops.py declares them, seconds) of the CPU flash forward and backward, causal."""
    from parallel3d.kernels.attention_backend import sdpa_attention_backward, sdpa_attention_with_lse

    fwd, bwd = [], []
    b, heads, d = 1, 4, 32
    for s in (64, 128, 256, 512):
        q, k, v = (torch.randn(b, s, heads, d) for _ in range(3))
        scale = d ** -0.5
        pairs = s * (s + 1) / 2
        out, lse = sdpa_attention_with_lse(q, k, v, True, scale)
        fwd.append([4.0 * b * heads * pairs * d, best(lambda: sdpa_attention_with_lse(q, k, v, True, scale), 3)])
        bwd.append([10.0 * b * heads * pairs * d,
                    best(lambda: sdpa_attention_backward(out, q, k, v, out, lse, True, scale), 3)])
    return {"flash_attention_fwd": fwd, "flash_attention_bwd": bwd}


def _step_overhead(stage_builder, model) -> float:
    """Seconds per tracked op of the real Trainer's step on a minimal model (module docstring)."""
    from parallel3d.mesh import MeshSpec, ParallelContext
    from parallel3d.planner.dryrun import tracked_step
    from parallel3d.training.config import ExperimentConfig
    from parallel3d.training.trainer import Trainer
    from parallel3d.training.validate import resolve_and_validate

    cfg = ExperimentConfig(model=copy.deepcopy(model))
    m, t = cfg.model, cfg.train
    m.vocab_size, m.hidden_size, m.num_layers, m.num_heads, m.num_kv_heads = 64, 16, 2, 2, 2
    m.ffn_hidden_size, m.max_seq_len, m.num_experts = 32, 16, 0
    t.seq_len, t.micro_batch_size, t.global_batch_size, t.precision, t.warmup_steps = 16, 1, 2, "fp32", 0
    cfg.train.eval_interval, cfg.checkpoint.interval = 0, 0
    cfg = resolve_and_validate(cfg, 1)
    ctx = ParallelContext.build(MeshSpec())
    trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx))
    step_s = median_seconds(trainer.train_step, 9)   # a typical step (the fastest of 8 gave 8.7-11.2 us per op)
    out, tracker = tracked_step(trainer, "cpu", signatures=True)
    return _host_per_op(step_s, out, tracker)


def _host_per_op(step_s: float, out: dict, tracker) -> float:
    """Seconds per tracked op of a step of `step_s` that the host spends around its ops: the step less
    the ops' replayed kernels (op_replay.py, in order by action as a plan prices them), over the op count."""
    from parallel3d.planner.step_costs import in_order_stretches

    stretches, prefixes = in_order_stretches(out, tracker, 0)
    kernels = op_replay.measure(tracker.signatures, stretches=stretches)
    replayed = sum(op_replay.replayed_seconds(kernels, op.key, p) or 0.0 for op, p in zip(tracker.ops, prefixes))
    return max(step_s - replayed, 0.0) / max(len(tracker.ops), 1)


def _op_overhead() -> float:
    """Seconds per aten op of a small model-like forward + backward (nn modules, autograd), where the
    arithmetic itself is negligible: what eager PyTorch costs per op on this host around its kernels."""
    from parallel3d.planner.tracker import StepTracker

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8),
                                                      torch.nn.SiLU()) for _ in range(8)])
    x = torch.randn(4, 8)

    def step():
        model(x).sum().backward()

    tracker = StepTracker(device_type="cpu", signatures={})
    with tracker:
        step()
    return _host_per_op(median_seconds(step, 20), {"actions": []}, tracker)   # no actions: one stretch


def load_profile(world: int, reprofile: bool = False, path: Optional[Path] = None,
                 builder: Optional[tuple] = None) -> dict:
    """The cached profile with this world size's gloo figures, measured (and written) where missing."""
    path = path or cache_path()
    profile: dict = {}
    if path.exists() and not reprofile:
        try:
            profile = json.loads(path.read_text())
        except ValueError:
            profile = {}
    changed = False
    if "compute" not in profile or profile.get("version") != VERSION:
        profile = {"version": VERSION, "host": socket.gethostname(), "cores": cores(),
                   "compute": measure_compute(builder), "gloo": {}}
        changed = True
    if str(world) not in profile["gloo"] and world > 1:
        profile["gloo"][str(world)] = measure_gloo(world)
        changed = True
    if changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(profile, indent=1))
        tmp.replace(path)
    return profile


def cpu_device(world: int, reprofile: bool = False, path: Optional[Path] = None,
               builder: Optional[tuple] = None) -> GPU:
    """This machine as the planner's device for `world` ranks (module docstring). `builder`: (the launch
    scripts' stage builder, a default model config), for the per-op overhead of the real step."""
    path = path or cache_path()
    ops = path.with_name(f"ops-{path.name}")   # replayed op times (op_replay.py)
    if reprofile:
        ops.unlink(missing_ok=True)
    profile = load_profile(world, reprofile, path, builder)
    c = profile["compute"]
    share = min(1.0, profile["cores"] / max(world, 1))   # ranks time-slice the cores they share
    gloo = profile["gloo"].get(str(world), {"collectives": {}, "base_rss_bytes": 0})
    # what `world` ranks computing at once measured against one alone (shared caches, memory bandwidth,
    # vCPUs that share a physical core), on top of the time-slicing when ranks outnumber the cores
    slow = gloo.get("slowdown", {})
    mm, per_op, memory = (slow.get(k, 1.0) / share for k in ("matmul", "op", "memory"))
    curves = {k: tuple((f, s * mm) for f, s in rows) for k, rows in c["matmul"].items()}
    peaks = {k: max(f / s for f, s in rows) for k, rows in curves.items()}
    curves.update({op: tuple((f, s * mm) for f, s in rows) for op, rows in c.get("attention", {}).items()})
    peaks["tf32"] = peaks["fp32"]
    links = {op: tuple(v) for op, v in gloo["collectives"].items()}
    links["recv"] = links.get("send", (0.0, 1.0))
    alpha, beta = links.get("all_gather", (0.0, 1e12))
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(world, 1)
    return GPU(f"cpu ({profile['cores']} cores, {world} ranks, 1 thread each)", peaks,
               c["memory_bytes_per_s"] / mm, total, beta, beta, pcie_bytes_per_s=c["memory_bytes_per_s"],
               matmul_efficiency=1.0, memory_efficiency=1.0, nvlink_efficiency=1.0, network_efficiency=1.0,
               nvlink_latency_s=alpha, network_latency_s=alpha, reserved_bytes=gloo["base_rss_bytes"],
               matmul_curves=curves, op_overhead_s=c["op_overhead_s"] * per_op, host_op_s=0.0, host_step_op_s=0.0,
               collectives=links, comm_wake_s=gloo.get("wake"), comm_wake_gap_s=gloo.get("wake_gap_s", 0.0),
               op_times=ops, op_time_scale=mm, cache_bytes=c["cache_bytes"] / max(world, 1),  # a shared cache
               cold_s_per_byte=max(0.0, 1 / c["memory_bytes_per_s_cold"] - 1 / c["hot_bytes_per_s"]) * memory,
               host_step_params_per_s=c["host_step_params_per_s"] * share,
               overlaps_comm=profile["cores"] > world, comm_busy=gloo.get("busy"), runs_cpu_kernels=True)
