"""Context-parallel attention per-rank time (forward + backward): ring / allgather / ulysses vs the ideal.

    python benchmarks/ring_attention.py [--seq 1024] [--heads 8] [--kv-heads 2] [--head-dim 64] [--cps 2 4]

The ideal for cp ranks is torch SDPA (fused, causal, GQA) on the whole sequence on one rank, divided by cp
(the best single-device attention, not our own block code); the table prints
ms per rank (slowest rank, median over iterations), the ratio to that ideal, and the ratio to our own
world-1 attention / cp ("vs ours": on the CPU our causal calls run in bands, kernels/attention_backend.py,
which computes fewer scores than SDPA's causal kernel, so this is the stricter ideal) (1.00 = perfect scaling;
causal work is quadratic, so a naive contiguous split would be far worse for the last rank).
Runs on gloo CPU by default (one thread per rank): on a machine with fewer cores than ranks the ranks
share cores and the ratios include that contention. Timings are never asserted anywhere.

Packed documents (--doc-len L, default 64): the ring with document masking over one document spanning
the sequence vs documents of L tokens at the same sequence length; with short documents the ring skips
the blocks no local query can see (the skipped share is printed from Documents.counters).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

MODES = ("ring", "allgather", "ulysses")


def _time_fwd_bwd(q, k, v, group, mode: str, iters: int, backend: str, documents=None) -> float:
    """Median seconds of one forward + backward."""
    from parallel3d import comm
    from parallel3d.context_parallel import context_parallel_attention_with_lse

    times = []
    for i in range(iters + 2):  # two warm-up iterations
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        comm.barrier(group)
        t0 = time.perf_counter()
        out, _ = context_parallel_attention_with_lse(qq, kk, vv, group, mode, True, backend, documents=documents)
        out.sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _time_sdpa(w, shape: dict, iters: int) -> float:
    """Median seconds of SDPA forward + backward on the whole sequence (one rank, one thread). K/V are
    repeated to the query heads first: on the CPU `enable_gqa=True` takes SDPA's slow math path."""
    import torch.nn.functional as F

    torch.set_num_threads(1)
    q, k, v = (t.transpose(1, 2).contiguous() for t in _inputs(shape, shape["seq"]))  # (b, h, s, d)
    rep = shape["hq"] // shape["hk"]
    times = []
    for i in range(iters + 2):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        t0 = time.perf_counter()
        F.scaled_dot_product_attention(qq, kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1),
                                       is_causal=True).sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _time_ours(w, shape: dict, iters: int, backend: str) -> float:
    """Median seconds of our own world-1 attention (kernels.dispatch.attention, GQA native; on the CPU aten's
    flash op in causal bands) forward + backward on the whole sequence, one thread: the stricter ideal."""
    from parallel3d.kernels import dispatch

    torch.set_num_threads(1)
    q, k, v = _inputs(shape, shape["seq"])  # (b, s, h, d)
    times = []
    for i in range(iters + 2):
        qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
        t0 = time.perf_counter()
        dispatch.attention(qq, kk, vv, True, None, backend).sum().backward()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _inputs(shape: dict, seq: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    b, hq, hk, d = shape["b"], shape["hq"], shape["hk"], shape["d"]
    return (torch.randn(b, seq, hq, d, generator=gen), torch.randn(b, seq, hk, d, generator=gen),
            torch.randn(b, seq, hk, d, generator=gen))


def _bench_rank(w, shape: dict, modes: tuple, iters: int, backend: str) -> dict:
    from parallel3d.context_parallel import shard_sequence
    from parallel3d.mesh import MeshSpec

    ctx = w.context(MeshSpec(cp=w.world_size))
    q, k, v = (shard_sequence(t, w.world_size, ctx.cp.rank) for t in _inputs(shape, shape["seq"]))
    return {m: _time_fwd_bwd(q, k, v, ctx.cp, m, iters, backend) for m in modes}


def _bench_documents(w, shape: dict, doc_len: int, iters: int, backend: str) -> dict:
    """Ring fwd+bwd seconds with document masking: documents of doc_len tokens (0: one document)."""
    from parallel3d.context_parallel import Documents, shard_sequence
    from parallel3d.mesh import MeshSpec

    ctx = w.context(MeshSpec(cp=w.world_size))
    q, k, v = (shard_sequence(t, w.world_size, ctx.cp.rank) for t in _inputs(shape, shape["seq"]))
    pos = torch.arange(shape["seq"]).expand(shape["b"], -1)
    docs = Documents.from_host(pos // doc_len if doc_len else torch.zeros_like(pos))
    t = _time_fwd_bwd(q, k, v, ctx.cp, "ring", iters, backend, documents=docs)
    return {"s": t, **docs.counters}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--backend", default="auto", help="auto | torch | sdpa | triton (block attention backend)")
    ap.add_argument("--doc-len", type=int, default=64, help="tokens per document in the packed-document rows")
    args = ap.parse_args()
    from parallel3d.testing import WorldPool

    shape = dict(seq=args.seq, b=args.batch, hq=args.heads, hk=args.kv_heads, d=args.head_dim)
    pool = WorldPool(backend="gloo")
    try:
        single = pool.run(1, _time_sdpa, shape, args.iters, timeout=600)[0]
        ours = pool.run(1, _time_ours, shape, args.iters, args.backend, timeout=600)[0]
        print(f"seq={args.seq} batch={args.batch} heads={args.heads} kv_heads={args.kv_heads} "
              f"head_dim={args.head_dim} causal fwd+bwd, gloo CPU, {os.cpu_count()} cores, backend={args.backend}")
        print(f"SDPA, one rank, whole sequence: {single * 1e3:.1f} ms (the ideal is this / cp)")
        print(f"ours (backend={args.backend}), one rank, whole sequence: {ours * 1e3:.1f} ms (ratio vs ours: this / cp)")
        print(f"{'cp':>3} {'mode':>10} {'ms/rank':>9} {'ideal ms':>9} {'ratio':>6} {'vs ours':>8}")
        for cp in args.cps:
            per_rank = pool.run(cp, _bench_rank, shape, MODES, args.iters, args.backend, timeout=600)
            for m in MODES:
                t = max(r[m] for r in per_rank)  # the slowest rank sets the step time
                print(f"{cp:>3} {m:>10} {t * 1e3:>9.1f} {single / cp * 1e3:>9.1f} {t / (single / cp):>6.2f} "
                      f"{t / (ours / cp):>8.2f}")
        print(f"ring with document masking: one {args.seq}-token document vs documents of {args.doc_len} tokens")
        print(f"{'cp':>3} {'docs':>10} {'ms/rank':>9} {'blocks skipped':>15} {'vs one doc':>10}")
        for cp in args.cps:
            rows = {}
            for doc_len in (0, args.doc_len):
                per_rank = pool.run(cp, _bench_documents, shape, doc_len, args.iters, args.backend, timeout=600)
                t = max(r["s"] for r in per_rank)
                skipped = sum(r["ring_blocks_skipped"] for r in per_rank)
                planned = sum(r["ring_blocks"] for r in per_rank)
                rows[doc_len] = t
                label = "one" if doc_len == 0 else f"{args.seq // doc_len}x{doc_len}"
                print(f"{cp:>3} {label:>10} {t * 1e3:>9.1f} {f'{skipped}/{planned}':>15} {t / rows[0]:>10.2f}")
    finally:
        pool.close()


if __name__ == "__main__":
    main()
