"""Clean-exit stress test (make sweep; not in CI): many short 4-rank torchrun jobs, under CPU load, must all
exit 0. A worker aborting at interpreter exit ("terminate called without an active exception") makes
torchrun report the job failed even though training finished; this counts such runs.

    python tests/stress_clean_exit.py [--runs 40] [--load 2]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = [["parallel.tp=2"], ["parallel.tp=1", "parallel.pp=2", "parallel.zero=1"],
           ["parallel.tp=1", "parallel.zero=3", "checkpoint.async_save=true"],
           # the offload copy engine's worker thread and activation offload's hooks must not hang the exit
           ["parallel.tp=1", "parallel.zero=2", "parallel.offload_optimizer=cpu", "train.activation_offload=true"]]


def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10000))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--load", type=int, default=2, help="busy processes competing for the CPU")
    args = ap.parse_args()
    stop = mp.Event()
    burners = [mp.Process(target=_burn, args=(stop,), daemon=True) for _ in range(args.load)]
    for b in burners:
        b.start()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    failures = []
    try:
        for i in range(args.runs):
            layout = LAYOUTS[i % len(LAYOUTS)]
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                       "launch/pretrain.py", "--config", "configs/tiny.yaml", "train.steps=3", "train.seq_len=32",
                       "log.interval=100", f"checkpoint.save_dir={tmp}", *layout]
                t0 = time.time()
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
                status = "ok" if proc.returncode == 0 else f"FAILED rc={proc.returncode}"
                print(f"run {i + 1}/{args.runs} {' '.join(layout)}: {status} ({time.time() - t0:.1f} s)", flush=True)
                if proc.returncode != 0:
                    lines = proc.stderr.splitlines()  # the cause, not only torchrun's summary
                    cause = [ln for ln in lines if any(w in ln for w in ("Error", "terminate", "Abort", "SIG"))]
                    failures.append((layout, "\n".join(cause[:20] + lines[-15:])))
    finally:
        stop.set()
    for layout, err in failures:
        print(f"--- {layout}\n{err}")
    print(f"{args.runs - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
