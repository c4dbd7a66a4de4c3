"""Run every side-by-side benchmark once, small on CPU (gloo), full size when a GPU is present.

    python benchmarks/run_all.py [--only tensor_parallel pipeline ...]

Each benchmark prints its own ratio table; nothing here is asserted. GPU figures go to
benchmarks/RESULTS.md with device, date and commit.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CPU_ARGS = {  # small enough for a 2-core machine
    "kernels": ["--cpu-smoke"],
    "tensor_parallel": ["--hidden", "128", "--layers", "2", "--seq", "128", "--iters", "3"],
    "pipeline": ["--pps", "2", "--iters", "3"],
    "data_parallel": ["--hidden", "128", "--layers", "2", "--steps", "3"],
    "ring_attention": ["--seq", "512", "--cps", "2", "--iters", "3"],
    "moe": ["--iters", "5", "--ep", "1,2"],
    "training": ["--preset", "tiny", "100m", "--steps", "2"],
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=sorted(CPU_ARGS), default=sorted(CPU_ARGS))
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    failed = []
    for name in args.only:
        cmd = [sys.executable, os.path.join(HERE, f"{name}.py")] + ([] if gpu else CPU_ARGS[name])
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
