"""gloo's own reduce-scatter and all-gather against the ones comm runs on gloo (parallel3d/comm/gloo.py), and
the all-reduce DDP uses, on the same buffers.

    python benchmarks/gloo_collectives.py [--world 2] [--sizes 2048 65536 1048576 8388608 33554432]
                                          [--rounds 3]

For each size (bytes of the reduce-scatter input / the gathered output, fp32) every variant runs in turn,
`--rounds` times, each time the median of k calls (k from 200 for small sizes down to 10), and the fastest
round is kept: on a shared machine that is the least disturbed measurement. The table prints milliseconds
per call and ours / gloo's speed ratio (> 1: ours is faster). One thread per rank, as torchrun gives.
Timings are never asserted anywhere.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from parallel3d import comm  # noqa: E402
from parallel3d.mesh import MeshSpec  # noqa: E402
from parallel3d.testing import World  # noqa: E402


def _median_ms(fn, calls: int, group) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        comm.barrier(group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _run(w, sizes: list[int], rounds: int) -> dict:
    torch.set_num_threads(1)
    group = w.context(MeshSpec(dp=w.world_size)).dp
    n = w.world_size
    best: dict = {}
    for _ in range(rounds):
        for nbytes in sizes:
            numel = max(nbytes // 4 // n, 1) * n
            calls = 200 if numel < 100_000 else 40 if numel < 2_000_000 else 10
            inp, seg, full = torch.rand(numel), torch.empty(numel // n), torch.empty(numel)
            variants = {
                "all_reduce": lambda: comm.all_reduce(inp, group),
                "reduce_scatter": lambda: comm.wait_work(comm.start_reduce_scatter(seg, inp, group), group, "rs"),
                "all_gather": lambda: comm.wait_work(comm.start_all_gather(full, seg, group), group, "ag"),
            }
            for name, fn in variants.items():
                for ours in ((False,) if name == "all_reduce" else (False, True)):
                    on_gloo, comm.collectives.on_gloo = comm.collectives.on_gloo, (lambda g: ours)
                    try:
                        ms = _median_ms(fn, calls, group)
                    finally:
                        comm.collectives.on_gloo = on_gloo
                    key = (nbytes, name, ours)
                    best[key] = min(best.get(key, ms), ms)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 65536, 1 << 20, 8 << 20, 32 << 20])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    world = World(args.world, "gloo")
    try:
        res = world.run(_run, (args.sizes, args.rounds), {}, timeout=1800)
    finally:
        world.close()
    slowest = {k: max(r[k] for r in res) for k in res[0]}
    print(f"gloo, world {args.world}, torch {torch.__version__}, ms per call (slowest rank), fastest of "
          f"{args.rounds} rounds")
    print("| bytes | all_reduce | reduce_scatter gloo / ours | ratio | all_gather gloo / ours | ratio |")
    print("|---:|---:|---:|---:|---:|---:|")
    for nbytes in args.sizes:
        ar = slowest[(nbytes, "all_reduce", False)]
        cells = [f"{nbytes:,}", f"{ar:.3f}"]
        for name in ("reduce_scatter", "all_gather"):
            theirs, ours = slowest[(nbytes, name, False)], slowest[(nbytes, name, True)]
            cells += [f"{theirs:.3f} / {ours:.3f}", f"{theirs / ours:.2f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
