"""MoE layer benchmark: fwd+bwd step time of the expert computation and of expert parallelism.

    python benchmarks/moe.py [--hidden 128 --ffn 256 --experts 8 --top-k 2 --tokens 1024 --iters 10]

Table 1 (one process): the whole MoE layer (router, permutation, experts, combine) forward + backward with
  naive        Hugging Face Mixtral style: for every expert, mask-select its tokens, run it, index_add back
  loop         ours: tokens sorted by expert, one GEMM pair per expert on contiguous slices
  padded       ours: sorted tokens padded into (E, max_count, h), batched matmuls
Table 2 (gloo on CPU, one rank per process): the same layer with experts spread over ep = 1, 2, 4 ranks,
  each rank routing `--tokens` tokens (weak scaling), plus the all-to-all bytes each rank sends per step.
Timings are medians; never asserted anywhere (docs/architecture.md section 4).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.expert_parallel import MoELayer  # noqa: E402
from parallel3d.mesh import MeshSpec, ParallelContext  # noqa: E402
from parallel3d.params import init_parameters  # noqa: E402


def naive_forward(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's MixtralSparseMoeBlock loop on our weights (reference speed, single process)."""
    tokens = x.reshape(-1, x.shape[-1])  # (T, h)
    r = layer.router(tokens)
    ex, out = layer.experts, torch.zeros_like(tokens)
    for e in range(layer.num_experts):
        tok, slot = torch.where(r.indices == e)  # (n_e,)
        xe = tokens[tok]
        ye = F.linear(F.silu(F.linear(xe, ex.gate_proj[e])) * F.linear(xe, ex.up_proj[e]), ex.down_proj[e])
        out = out.index_add(0, tok, ye * r.weights[tok, slot, None])
    return out.view_as(x)


def step(fn, x: torch.Tensor) -> float:
    """Seconds of one forward + backward."""
    xi = x.detach().requires_grad_()
    t0 = time.perf_counter()
    fn(xi).square().mean().backward()
    return time.perf_counter() - t0


def time_steps(fn, x: torch.Tensor, iters: int) -> float:
    """Median seconds of forward + backward after 2 warm-up steps."""
    return statistics.median([step(fn, x) for _ in range(iters + 2)][2:])


def make_layer(args, ctx: ParallelContext, impl: str) -> MoELayer:
    layer = MoELayer(args.hidden, args.ffn, args.experts, args.top_k, ctx, impl=impl, backend="torch")
    init_parameters(layer, 0, 0.05)
    return layer


def single_process(args) -> list[tuple[str, float]]:
    """The implementations take turns step by step, so load from other processes hits them alike."""
    torch.set_num_threads(args.threads)
    ctx = ParallelContext.single()
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(0))
    fns = {}
    for name in ("naive", "loop", "padded"):
        layer = make_layer(args, ctx, "loop" if name == "naive" else name)
        fns[name] = (lambda t, l=layer: naive_forward(l, t)) if name == "naive" else layer
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(args.iters + 2):
        for name, fn in fns.items():
            seconds = step(fn, x)
            if i >= 2:
                times[name].append(seconds)
    return [(name, statistics.median(t)) for name, t in times.items()]


def _ep_worker(w, args) -> tuple[float, int]:
    ctx = w.context(MeshSpec(dp=w.world_size, ep=w.world_size))
    layer = make_layer(args, ctx, "loop")
    x = torch.randn(1, args.tokens, args.hidden, generator=torch.Generator().manual_seed(w.rank))
    seconds = time_steps(layer, x, args.iters)
    ctx.stats.reset()
    layer(x.requires_grad_()).square().mean().backward()
    sent = sum(b for (g, op), (_, b) in ctx.stats.summary().items() if op == "all_to_all")
    return seconds, sent


def expert_parallel(args) -> list[tuple[int, float, int]]:
    from parallel3d.testing import WorldPool

    pool, rows = WorldPool(backend="gloo"), []
    try:
        for ep in args.ep:
            out = pool.run(ep, _ep_worker, args, timeout=600)
            rows.append((ep, max(s for s, _ in out), max(b for _, b in out)))
    finally:
        pool.close()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ep", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4])
    args = p.parse_args()
    print(f"MoE layer: hidden {args.hidden}, ffn {args.ffn}, {args.experts} experts, top-{args.top_k}, "
          f"{args.tokens} tokens/rank, {torch.get_num_threads() if args.threads <= 0 else args.threads} thread(s), "
          f"torch {torch.__version__}")
    rows = single_process(args)
    base = rows[0][1]
    print("\n| experts impl | fwd+bwd ms | speed-up vs naive |\n|---|---:|---:|")
    for name, s in rows:
        print(f"| {name} | {s * 1e3:.2f} | {base / s:.2f}x |")
    ep_rows = expert_parallel(args)
    print("\n| ep (gloo, CPU) | fwd+bwd ms (slowest rank) | all-to-all MiB sent/rank/step |\n|---:|---:|---:|")
    for ep, s, sent in ep_rows:
        print(f"| {ep} | {s * 1e3:.2f} | {sent / 2**20:.2f} |")


if __name__ == "__main__":
    main()
