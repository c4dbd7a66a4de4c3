"""The collective and contention half of this machine's profile (profile.py): gloo's (alpha, beta) per
collective at a world size, the process's resident memory before any model, and what `world` ranks
computing at once cost each other. Measured on `world` spawned processes of one thread each.

A collective is timed as a training step calls it: after a short matmul on every rank and without a
barrier, so the ranks arrive as they finish computing, and averaged over the calls (`typical`), since a
step pays each call's cost, not the fastest. Timed back to back behind barriers and taking the fastest,
a 64 KiB all-reduce measured about 0.3 ms on this machine's two ranks, while tiny's TP step waited 1.1 ms
in each of its 80 all-reduces; after a quarter millisecond of matmul it averaged 0.8 ms.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "send")
SMALL, LARGE = 1024, 4 * 2 ** 20   # bytes of the two gloo message sizes
# calls timed at LARGE: with 12, the all-gather's bandwidth came out 1.4, 1.7 and 4.6 GB/s in three
# profiles of one afternoon, and the reduce-scatter's busy share 0.30-0.65
LARGE_CALLS, SMALL_CALLS = 40, 80   # per round
# Every op is timed in ROUNDS rounds over all of them, each figure the median of its rounds' (`typical`): timed
# in one go, an op took whatever moment the VM was having, and two profiles 12 minutes apart gave the
# all-reduce 1.06 and 0.43 ms of latency, the all-to-all 0.60 and 1.33 (tiny's TP and CP moved 0.66-1.58x).
ROUNDS = 3
# The processes are started GROUPS times and each figure is the median over the groups: a pair of processes
# keeps its speed for its life, and three pairs in one minute on this VM measured the 1 KiB all-gather at
# 1.95, 0.35 and 0.46 ms (the profile of the run before had 1.28 ms, and tiny's SP step paid 0.81 a call).
GROUPS = 3
# A collective costs more when the ranks arrive from a longer stretch of compute: on this 2-core VM a
# 1 KiB all-reduce averaged 0.56 ms after 0-0.25 ms of matmul, 0.95 after 1 ms, 1.4-1.6 after 3-10 ms
# (most calls take 0.3 ms; more of them then wait about 4 ms, a scheduler tick, for a thread to run).
# The wake probe times each collective after this much compute, as a transformer layer's TP exit meets it.
WAKE_GAP_S, SHORT_GAP_S = 3e-3, 2.5e-4
# BUSY_NOTE: a collective started beside compute (a bucket's reduce-scatter, a ring-attention transfer) runs
# on gloo's threads; where the ranks fill the cores, those threads take a core from the compute for the
# share of the call they are busy (copying, summing, the socket's work: process CPU seconds over wall
# seconds), and only the rest of the call hides (cost.hidden_share). Two ranks on this VM, 146 MiB: the
# all-reduce 0.75-0.77 busy, the all-to-all of the reduce-scatter 0.55-0.73, the all-gather 0.72-0.76; a
# ZeRO-2 step of llama_100m paid about 0.25 s for each microbatch's 0.34 s of reduce-scatters.


def best(fn, repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def median_seconds(fn, repeats: int) -> float:
    """The median seconds of `repeats` calls of `fn` after one: what a typical call costs, as a run's
    logged step is the median of its steps (the fastest call, `best`, is what a quiet moment gave)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return max(sorted(times)[len(times) // 2], 1e-9)


def typical(seconds: list) -> float:
    """The mean of all calls but the slowest: what a step that calls the collective many times pays on
    average, without one hiccup of the machine (it once fitted all-to-all with a 3.6 ms latency).

    Not the mean of all but the slowest tenth, as before: on this VM 10-20% of the calls wait about 4 ms (a
    scheduler tick), and a step pays those too. Two ranks, 768 KiB all-reduces after a quarter
    millisecond of matmul: 2.39 ms a call on average, 1.89 without the slowest tenth, 2.36 without the
    slowest call; llama_100m's TP step paid about 2.5 ms per such all-reduce (RESULTS.md)."""
    kept = sorted(seconds)[:-1] if len(seconds) > 1 else list(seconds)
    return max(sum(kept) / len(kept), 1e-9)


def _contention_probe() -> dict:
    """Seconds of a 256^3 fp32 matmul and of a tiny in-place add (per-op cost) on one thread: run alone
    and by every rank at once, their ratio is what sharing the machine costs each rank's compute.

    Each is the mean over a fixed stretch of time (the median of three), not the fastest call: ranks
    started together by a barrier then overlap for the whole stretch, as a run's ranks do. The fastest of
    a few short calls had caught moments when the other rank was not computing, and the slowdown it
    measured moved between 1.0 and 1.37 from one profile to the next."""
    torch.set_num_threads(1)
    a, b, x = torch.randn(256, 256), torch.randn(256, 256), torch.zeros(16)
    big = [torch.full((1 << 24,), 1.0) for _ in range(3)]   # 192 MiB: past the cache, as optimizer state is
    return {"matmul": _mean_seconds(lambda: a @ b, 0.1), "op": _mean_seconds(lambda: x.add_(1), 0.05),
            "memory": _mean_seconds(lambda: torch.add(big[0], big[1], out=big[2]), 0.15)}


def _mean_seconds(fn, stretch_s: float) -> float:
    """The median over three stretches of `stretch_s` seconds of the mean seconds per call of `fn`."""
    fn()
    means = []
    for _ in range(3):
        calls, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < stretch_s:
            fn()
            calls += 1
        means.append((time.perf_counter() - t0) / calls)
    return sorted(means)[1]


def _resident_bytes() -> int:
    """This process's resident memory now (not its peak: importing and spawning pass through transients)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _gloo_worker(rank: int, world: int, store_path: str, out_path: str) -> None:
    import torch.distributed as dist

    from parallel3d import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    group = comm.Group("world", list(range(world)), rank, dist.group.WORLD, None, torch.device("cpu"))
    base_rss = _resident_bytes()
    dist.barrier()
    together = _contention_probe()   # every rank at once, as the ranks of a run compute
    work = torch.randn(256, 256)     # a quarter of a millisecond of matmul before each timed collective
    calls = {(op, nbytes): _collective_call(op, nbytes, group, rank, world) for op in COLLECTIVES
             for nbytes in (SMALL, LARGE)}
    for run in calls.values():
        run()   # a first call may set up (connections, buffers): not a timing
    rounds: dict = {key: [] for key in calls}
    wall, cpu = dict.fromkeys(calls, 0.0), dict.fromkeys(calls, 0.0)
    for _ in range(ROUNDS):
        for (op, nbytes), run in calls.items():
            dist.barrier()
            seconds = []
            for _ in range(SMALL_CALLS if nbytes == SMALL else LARGE_CALLS):
                work @ work   # as in a step: each rank arrives from its own compute, no barrier lines them up
                c0, t0 = time.process_time(), time.perf_counter()
                run()
                seconds.append(time.perf_counter() - t0)
                cpu[op, nbytes] += time.process_time() - c0   # every thread of the process: gloo's and this one
            wall[op, nbytes] += sum(seconds)
            rounds[op, nbytes].append(typical(seconds))
    result = {op: [statistics.median(rounds[op, nbytes]) for nbytes in (SMALL, LARGE)] for op in COLLECTIVES}
    # the share of a LARGE call a core was busy moving and summing (BUSY_NOTE)
    busy = {op: min(1.0, cpu[op, LARGE] / max(wall[op, LARGE], 1e-9)) for op in COLLECTIVES}
    wake = {op: _wake(calls[op, SMALL], 200) for op in COLLECTIVES}   # the SMALL calls after long compute
    if rank == 0:
        Path(out_path).write_text(json.dumps({"times": result, "base_rss_bytes": base_rss,
                                              "together": together, "wake": wake, "busy": busy}))
    dist.barrier()
    dist.destroy_process_group()


def _collective_call(op: str, nbytes: int, group, rank: int, world: int):
    """One call of collective `op` of `nbytes` over `group`, through comm's own functions, as a closure."""
    from parallel3d import comm

    numel = nbytes // 4
    t, out = torch.ones(numel), torch.empty(numel // world)

    def run():
        if op == "all_reduce":
            comm.all_reduce(t, group)
        elif op == "reduce_scatter":   # the transfer only: the sum on wait is an op the dry run
            comm.start_reduce_scatter(out, t, group).work.wait()   # prices at its real size
        elif op == "all_gather":   # in place, the transfer only: the copy of a rank's own block is an
            own = t.view(world, -1)[rank]   # op the dry run prices (comm.gloo.own_block)
            comm.wait_work(comm.start_all_gather(t, own, group), group, "all_gather")
        elif op == "all_to_all":
            comm.all_to_all(t, group)
        else:  # a pipeline message: every rank sends to the next and receives from the previous
            comm.batch_p2p([comm.P2P("send", t, (rank + 1) % world),
                            comm.P2P("recv", torch.empty_like(t), (rank - 1) % world)], group)
    return run


def _wake(run, calls: int, block: int = 10) -> float:
    """Mean seconds `run()` takes more after WAKE_GAP_S of matmul than after a quarter millisecond of it:
    `calls` calls after each, in alternating blocks of `block` (the effect needs a run of long stretches:
    alternating every call, it vanished; the blocks let a drift of the machine meet both alike), every
    call kept (the slow ones are what a step pays)."""
    a = torch.randn(128, 128)
    total = {SHORT_GAP_S: 0.0, WAKE_GAP_S: 0.0}
    for _ in range(calls // block):
        for gap in total:
            for _ in range(block):
                end = time.perf_counter() + gap
                while time.perf_counter() < end:
                    a @ a
                t0 = time.perf_counter()
                run()
                total[gap] += time.perf_counter() - t0
    return max(0.0, (total[WAKE_GAP_S] - total[SHORT_GAP_S]) / (calls // block * block))


def _median_of(found: list):
    """Every number of the workers' reports (nested dicts and lists of one shape), the median over them."""
    first = found[0]
    if isinstance(first, dict):
        return {k: _median_of([f[k] for f in found]) for k in first}
    if isinstance(first, list):
        return [_median_of([f[i] for f in found]) for i in range(len(first))]
    return statistics.median(found)


def _solve(op: str, world: int, small_s: float, large_s: float) -> tuple[float, float]:
    """(alpha, beta) such that cost.collective_time(op, bytes, world, alpha, beta) gives both timings."""
    n = world
    steps = {"all_reduce": 2 * (n - 1), "send": 1}.get(op, n - 1)
    frac = {"all_reduce": 2 * (n - 1) / n, "send": 1.0}.get(op, (n - 1) / n)
    per_byte = max((large_s - small_s) / (LARGE - SMALL), 1e-13)
    alpha = max(small_s - per_byte * SMALL, 1e-7) / steps
    return alpha, frac / per_byte


def measure_gloo(world: int) -> dict:
    """(alpha, beta) per collective on `world` local gloo processes, each figure the median over GROUPS
    groups of fresh processes (about 15 s each on this 2-core VM)."""
    import torch.multiprocessing as mp

    threads = torch.get_num_threads()
    try:
        alone = _contention_probe()
    finally:
        torch.set_num_threads(threads)
    groups = []
    for _ in range(GROUPS):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            mp.start_processes(_gloo_worker, args=(world, os.path.join(tmp, "store"), out), nprocs=world,
                               start_method="spawn")
            groups.append(json.loads(Path(out).read_text()))
    found = _median_of(groups)
    links = {op: list(_solve(op, world, *t)) for op, t in found["times"].items()}
    slowdown = {k: max(1.0, found["together"][k] / alone[k]) for k in alone}
    return {"collectives": links, "base_rss_bytes": found["base_rss_bytes"], "slowdown": slowdown,
            "wake": found["wake"], "wake_gap_s": WAKE_GAP_S, "busy": found["busy"]}
