"""Grouped experts (model.expert_impl): forward + backward time of the SwiGLU experts per implementation.

    python benchmarks/experts.py [--tokens 4096] [--iters 5]

Rows arrive sorted by expert with uneven counts (a softmax top-k routing's typical skew). `triton` runs only
on CUDA (under TRITON_INTERPRET=1 it is a correctness path, not a speed one). Medians; never asserted.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from parallel3d.expert_parallel.experts import choose_impl, grouped_swiglu  # noqa: E402

SHAPES = {"mixtral-like E=8 h=512 f=1024": (8, 512, 1024), "fine-grained E=64 h=512 f=128": (64, 512, 128)}


def _counts(tokens: int, experts: int) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    share = torch.rand(experts, generator=gen) + 0.5
    counts = (share / share.sum() * tokens).long()
    counts[0] += tokens - counts.sum()
    return counts.tolist()


def bench(impl: str, e: int, h: int, f: int, tokens: int, iters: int, device: str) -> float:
    gen = torch.Generator().manual_seed(1)
    ws = [(0.02 * torch.randn(*s, generator=gen)).to(device).requires_grad_() for s in ((e, f, h), (e, f, h), (e, h, f))]
    x = torch.randn(tokens, h, generator=gen).to(device).requires_grad_()
    counts = _counts(tokens, e)
    times = []
    for _ in range(iters + 1):
        t0 = time.perf_counter()
        grouped_swiglu(impl, x, counts, *ws, backend="torch").backward(torch.ones(tokens, h, device=device))
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[iters // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    impls = ["loop", "padded", "grouped_mm"] + (["triton"] if device == "cuda" else [])
    print(f"experts fwd+bwd, {args.tokens} routed rows, fp32, {device}; auto = "
          f"{choose_impl('auto', torch.zeros(1, device=device), 512, 1024)}")
    print(f"{'shape':32} " + " ".join(f"{i + ' ms':>14}" for i in impls) + f" {'loop/grouped_mm':>16}")
    for name, (e, h, f) in SHAPES.items():
        ms = {i: bench(i, e, h, f, args.tokens, args.iters, device) * 1e3 for i in impls}
        print(f"{name:32} " + " ".join(f"{ms[i]:>14.1f}" for i in impls) + f" {ms['loop'] / ms['grouped_mm']:>16.2f}")


if __name__ == "__main__":
    main()
