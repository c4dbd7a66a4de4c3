"""Running a layout for planner_accuracy.py and reading the run: one run through `launch/pretrain.py` under
torchrun (`measure`), the machine's speed now (`reference_s`), a layout's median round and the ranking of
layouts by predicted and measured time."""
from __future__ import annotations

import multiprocessing
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from parallel3d.planner.compare import read_run
from parallel3d.planner.profile_gloo import median_seconds

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def measure(config: str, overrides: list[str], steps: int, tmp: Path, name: str, world: int,
            ep: int = 1, timeline_steps: int = 1) -> dict:
    """One run of `steps` steps; its pipeline figures from the timeline of its last `timeline_steps` steps."""
    jsonl, timeline = tmp / f"{name}.jsonl", tmp / f"{name}.timeline.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(ROOT / "launch/pretrain.py"), "--config", str(ROOT / config), *overrides, f"train.steps={steps}",
           f"log.jsonl={jsonl}", f"log.timeline={timeline}", "log.timeline_step=-1",
           f"log.timeline_steps={timeline_steps}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - t0
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: {' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    run = read_run(str(jsonl), str(timeline) if timeline.exists() else None, ep)
    # the share of a core each rank got over the run (start-up included): 1 on a quiet machine with a core
    # per rank; under load the measured times are stretched by about its inverse (a diagnostic, not used)
    row = {"measured_s": run["step_time_s"], "measured_peak_bytes": run["peak_mem_bytes"],
           "measured_bubble": run.get("bubble"), "cpu_share": min(1.0, cpu / (wall * world))}
    if "moe_load" in run:
        row["moe_load"] = run["moe_load"]
    row["measured_q1_s"], row["measured_q3_s"] = run["step_time_q1_s"], run["step_time_q3_s"]
    if "pipeline_s" in run:  # the timeline's steps: the pipeline's span, and the rest of each step (medians)
        row["measured_pipeline_s"] = run["pipeline_s"]
        row["measured_after_s"] = run.get("after_pipeline_s")
    return row


def reference_s() -> float:
    """This machine's speed now, on one core: a fixed piece of work (a bf16 and an fp32 GEMM of llama_100m's
    sizes and an element-wise pass over 64 MiB, on one thread), the median of 5 calls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a16, b16 = torch.randn(256, 768).bfloat16(), torch.randn(768, 2048).bfloat16()
    a32, b32 = torch.randn(256, 768), torch.randn(768, 768)
    stream = torch.randn(16 << 20)

    def work():
        for _ in range(4):
            a16 @ b16
            a32 @ b32
        stream.mul_(1.0)
    try:
        return median_seconds(work, 5)
    finally:
        torch.set_num_threads(threads)


def _reference_at(start: float) -> float:
    """reference_s in a worker of Reference's pool, begun at wall time `start` with the other workers."""
    while time.time() < start:
        pass
    return reference_s()


class Reference:
    """The machine's speed as a run of `ranks` ranks meets it: reference_s on `ranks` processes at once, the
    slowest one's. A VM's speed drifts between and within runs; a run's reference over the one taken after
    the profile says how far the machine moved under the plan: a diagnostic printed beside the ratio, never
    a correction. Why all ranks at once: this VM slows one vCPU at a time, to about half speed, for seconds
    (one probe alone 0.23-0.49 ms, two at once 0.24 and 0.48 in the same half second), and ranks in lock
    step wait for the slowest, so a one-core reference read 0.97x through rounds that ran 1.4x slow."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.pool = multiprocessing.get_context("spawn").Pool(ranks) if ranks > 1 else None

    def __call__(self) -> float:
        if self.pool is None:
            return reference_s()
        start = time.time() + 0.5   # every worker has its task by then
        return max(self.pool.map(_reference_at, [start] * self.ranks, chunksize=1))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def median_round(runs: list[dict]) -> dict:
    """The run whose step time is the median of a layout's rounds (the lower middle of an even number),
    whole, so its components and peak stay those of one run; with every round's time beside it."""
    ordered = sorted(runs, key=lambda r: r["measured_s"])
    return {**ordered[(len(ordered) - 1) // 2], "measured_rounds_s": [r["measured_s"] for r in runs]}


def ranking(rows: list[dict]) -> dict:
    by_pred = [r["layout"] for r in sorted(rows, key=lambda r: r["predicted_s"])]
    by_meas = [r["layout"] for r in sorted(rows, key=lambda r: r["measured_s"])]
    best = min(r["measured_s"] for r in rows)
    picked = next(r for r in rows if r["layout"] == by_pred[0])
    return {"predicted_order": by_pred, "measured_order": by_meas, "orders_match": by_pred == by_meas,
            "planner_best": by_pred[0], "measured_best": by_meas[0],
            "planner_best_vs_measured_best": picked["measured_s"] / best}
