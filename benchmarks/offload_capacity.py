"""The largest Llama-shaped model one GPU trains with each offload mode, from the planner's dry run.

    python benchmarks/offload_capacity.py [--gpu h100] [--seq 4096] [--modes none,optimizer,zero3]
                                          [--sizes 8b,13b,...] [--json]

Every candidate is the real training step dry-run on the `meta` stand-in (launch/plan.py's planner) at
world size 1: seq 4096, micro-batch 1, one microbatch, full activation recomputation, bf16, fused head.
Modes (parallel.* overrides):
    none        zero=0, everything on the device
    optimizer   zero=0 (world size 1: params are views of one flat buffer, no gather buffers),
                offload_optimizer=cpu: master + Adam state on the host, gradients streamed to the
                host bucket by bucket (offload/host_grads.py); nvme keeps the same device memory
    zero3       zero=3, offload_params=cpu, offload_optimizer=cpu: the parameter shard too; the device
                holds the gathered units in use, activations and the gradient buckets in flight
For each mode the ladder of shapes below is binary-searched for the largest that fits (the planner's
`fits`: peak <= the GPU's memory less its reserve). Not a timing benchmark: memory is deterministic.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "launch"))

from common import stage_builder  # noqa: E402
from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.planner.estimate import plan  # noqa: E402
from parallel3d.planner.hardware import gpu as find_gpu  # noqa: E402
from parallel3d.training.config import load_config  # noqa: E402
from parallel3d.training.metrics import total_params  # noqa: E402
from parallel3d.training.validate import resolve_and_validate  # noqa: E402

GiB = 2 ** 30
# name: (hidden, layers, ffn, heads, kv heads); Llama-3 vocabulary (128256), untied head
LADDER = {
    "1b": (2048, 16, 8192, 32, 8), "3b": (3072, 28, 8192, 24, 8), "8b": (4096, 32, 14336, 32, 8),
    "13b": (5120, 40, 13824, 40, 8), "20b": (6144, 48, 16384, 48, 8), "30b": (6656, 64, 17920, 52, 4),
    "34b": (8192, 48, 22016, 64, 8), "45b": (8192, 64, 22016, 64, 8), "70b": (8192, 80, 28672, 64, 8),
    "90b": (8192, 100, 28672, 64, 8), "120b": (8192, 136, 28672, 64, 8),
}
MODES = {
    "none": ["parallel.zero=0"],
    "optimizer": ["parallel.zero=0", "parallel.offload_optimizer=cpu"],
    "zero3": ["parallel.zero=3", "parallel.offload_params=cpu", "parallel.offload_optimizer=cpu"],
}


def shape(size: str) -> list[str]:
    """The model overrides of ladder rung `size` (benchmarks/planner_published.py plans one of them too)."""
    h, layers, ffn, heads, kv = LADDER[size]
    return [f"model.hidden_size={h}", f"model.num_layers={layers}", f"model.ffn_hidden_size={ffn}",
            f"model.num_heads={heads}", f"model.num_kv_heads={kv}"]


def config(size: str, mode: str, seq: int):
    overrides = [*shape(size), f"model.max_seq_len={seq}",
                 "parallel.tp=1", "parallel.sp=false", f"train.seq_len={seq}", "train.micro_batch_size=1",
                 "train.global_batch_size=1", "train.activation_checkpointing=full", "train.precision=bf16",
                 *MODES[mode]]
    cfg = load_config(os.path.join(ROOT, "configs", "llama3_8b.yaml"), overrides, ModelConfig)
    return resolve_and_validate(cfg, 1)


def evaluate(size: str, mode: str, seq: int, gpu) -> dict:
    cfg = config(size, mode, seq)
    result = plan(cfg, stage_builder, gpu, 8)
    row = {"size": size, "mode": mode, "params_b": total_params(cfg.model) / 1e9, "fits": result.fits,
           "peak_gib": result.memory["peak"] / GiB,
           "memory_gib": {k: round(v / GiB, 2) for k, v in result.memory.items()},
           "host_gib": result.breakdown["offload"].get("host_bytes", 0) / GiB}
    print(f"  {mode:9s} {size:>5s} ({row['params_b']:.1f}B): peak {row['peak_gib']:.1f} GiB "
          f"{'fits' if row['fits'] else 'does NOT fit'}  {row['memory_gib']}  host {row['host_gib']:.0f} GiB",
          flush=True)
    return row


def largest(mode: str, sizes: list[str], seq: int, gpu) -> tuple[dict | None, list[dict]]:
    """Binary search over the ladder (memory grows along it)."""
    lo, hi, best, rows = 0, len(sizes) - 1, None, []
    while lo <= hi:
        mid = (lo + hi) // 2
        row = evaluate(sizes[mid], mode, seq, gpu)
        rows.append(row)
        if row["fits"]:
            best, lo = row, mid + 1
        else:
            hi = mid - 1
    return best, rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--sizes", default=",".join(LADDER), help="the ladder to search, ascending")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    gpu = find_gpu(args.gpu)
    sizes = args.sizes.split(",")
    out = {}
    for mode in args.modes.split(","):
        print(f"{mode}:", flush=True)
        best, rows = largest(mode, sizes, args.seq, gpu)
        out[mode] = {"largest": best, "tried": rows}
        found = "none" if best is None else f"{best['size']} ({best['params_b']:.1f}B parameters)"
        print(f"  -> largest that fits on one {gpu.name} with offload mode {mode!r}: {found}", flush=True)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
