"""Where the time of a blocking gloo collective goes in a step: each rank's wait in it, how far apart the
ranks arrive, and how long it takes once both are in; then what the planner's profile would price
(`profile_gloo.typical`: every call but the slowest) beside the mean without the slowest tenth (the rule
before). RESULTS.md, "Collectives priced with their slow calls".

    python benchmarks/gloo_wait.py [--sizes 1024 786432 4194304] [--compute-ms 0.25 3] [--calls 200]

Two spawned ranks, one thread each, run the same matmuls for `--compute-ms` before every all-reduce (as TP
layers do) and time their arrival and exit on the shared monotonic clock. Milliseconds per call; timings
are never asserted anywhere.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from parallel3d.planner.profile_gloo import typical  # noqa: E402


def _rank(rank: int, store: str, out: str, nbytes: int, compute_s: float, calls: int) -> None:
    from parallel3d import comm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    group = comm.Group("world", [0, 1], rank, dist.group.WORLD, None, torch.device("cpu"))
    t, a = torch.ones(nbytes // 4), torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    reps = max(1, round(compute_s / ((time.perf_counter() - start) / 20)))
    comm.all_reduce(t, group)   # connections set up: not a timing
    dist.barrier()
    rows = []
    for _ in range(calls):
        for _ in range(reps):
            a @ a
        arrive = time.perf_counter()
        comm.all_reduce(t, group)
        rows.append((arrive, time.perf_counter()))
    Path(f"{out}.{rank}").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def measure(nbytes: int, compute_s: float, calls: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows")
        mp.start_processes(_rank, args=(os.path.join(tmp, "store"), out, nbytes, compute_s, calls), nprocs=2,
                           start_method="spawn")
        r0, r1 = (json.loads(open(f"{out}.{r}").read()) for r in range(2))
    waits = sorted(leave - arrive for rows in (r0, r1) for arrive, leave in rows)
    kept = waits[: len(waits) - len(waits) // 10]
    ms = 1e3
    return {"wait_mean": statistics.mean(waits) * ms, "wait_median": statistics.median(waits) * ms,
            "skew_mean": statistics.mean(abs(a0 - a1) for (a0, _), (a1, _) in zip(r0, r1)) * ms,
            "both_in_mean": statistics.mean(max(l0, l1) - max(a0, a1) for (a0, l0), (a1, l1) in zip(r0, r1)) * ms,
            "priced": typical(waits) * ms, "without_slowest_tenth": statistics.mean(kept) * ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 786432, 4194304])
    parser.add_argument("--compute-ms", type=float, nargs="+", default=[0.25, 3.0])
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}; ms per all-reduce, 2 ranks")
    print("KiB | compute ms | wait mean | wait median | arrival skew | both in | priced (typical) | "
          "without the slowest tenth")
    for nbytes in args.sizes:
        for compute_ms in args.compute_ms:
            r = measure(nbytes, compute_ms / 1e3, args.calls)
            print(f"{nbytes // 1024} | {compute_ms} | {r['wait_mean']:.2f} | {r['wait_median']:.2f} | "
                  f"{r['skew_mean']:.2f} | {r['both_in_mean']:.2f} | {r['priced']:.2f} | "
                  f"{r['without_slowest_tenth']:.2f}")


if __name__ == "__main__":
    main()
