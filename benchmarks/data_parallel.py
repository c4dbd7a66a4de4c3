"""Data-parallel benchmark: our DistributedOptimizer (ZeRO 0-3, HSDP, compression, ZeRO++) vs PyTorch DDP
and FSDP2 `fully_shard`.

    python benchmarks/data_parallel.py [--world 2] [--hidden 256] [--layers 4] [--vocab 4096] [--seq 64]
                                       [--batch 2] [--steps 5] [--rounds 1] [--precision fp32] [--markdown]
                                       [--impls ddp,ours-zero1,...] [--bucket-size N]

Implementations: ddp, fsdp2, ours-zero{0,1,2,3}, and ours-zero<z>-<mode> with mode one of hsdp (dp_shard =
world/2), powersgd (rank 4), topk (ratio 0.01), qwz, hpz (gpus_per_node = world/2), qgz, zeropp (all
three) or overlap (ZeRO-1/2: each bucket's parameter all-gather is waited for by its first use in the next
forward); compression starts at step 0 here. `comm MB/step` is this rank's bytes in one step, from the comm
layer's accounting (DDP/FSDP2: their logical volumes, all-reduce P, all-gathers 2P + reduce-scatter P).
--rounds R runs the whole list R times (a fresh world each time) and keeps each implementation's fastest
median: on a shared machine that is the least disturbed measurement.

Same Llama model, same per-rank batch, AdamW, one microbatch per step. For each implementation it reports
the median step time (forward + backward + gradient sync + optimizer step) over `--steps` timed steps
after two warm-up steps, the model-state bytes per rank (parameters + gradients + optimizer state,
counted from the live tensors: FSDP2's DTensor shards by their local part) and the peak memory
(CUDA: max_memory_allocated; CPU: growth of the process's peak RSS, coarse). Every implementation
runs in a freshly spawned world so peak RSS is its own. Ratios compare ours with the PyTorch built-in of
the same memory class: ZeRO-0 vs DDP, ZeRO-3 vs FSDP2 (> 1 means ours is faster / smaller). On a CPU every
implementation's ranks keep freed host memory for reuse (parallel3d/host_memory.py), as our launch scripts
set for a CPU run.
Timings are never asserted anywhere (docs/architecture.md section 4).
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.host_memory import keep_freed_memory  # noqa: E402
from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.models.llama import Llama  # noqa: E402
from parallel3d.data_parallel import DataParallelConfig, attach  # noqa: E402
from parallel3d.mesh import MeshSpec, ParallelContext  # noqa: E402
from parallel3d.testing import World  # noqa: E402

IMPLS = ["ddp", "ours-zero0", "ours-zero1", "ours-zero1-overlap", "ours-zero2", "ours-zero2-overlap", "fsdp2",
         "ours-zero3"]
MODES = {  # extra DataParallelConfig fields per mode (ZeRO++: with quant_block 256)
    "powersgd": dict(grad_compression="powersgd", powersgd_rank=4, compression_start_step=0),
    "topk": dict(grad_compression="topk", topk_ratio=0.01, compression_start_step=0),
    "qwz": dict(quantized_weights=True),
    "hpz": dict(hpz=True),
    "qgz": dict(quantized_gradients=True),
    "zeropp": dict(quantized_weights=True, hpz=True, quantized_gradients=True),
    "hsdp": {},
    "overlap": dict(overlap_param_gather=True),   # ZeRO-1/2: the parameter gathers beside the next forward
}


def _bytes(t: torch.Tensor) -> int:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.numel() * t.element_size()


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _run(w, impl: str, a: dict) -> dict:
    torch.manual_seed(0)
    cuda = w.device.type == "cuda"
    if not cuda:   # every implementation's ranks reuse freed host memory, as launch/common.py sets for ours
        keep_freed_memory()
    rss0 = _peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    cfg = ModelConfig(vocab_size=a["vocab"], hidden_size=a["hidden"], num_layers=a["layers"],
                      num_heads=max(1, a["hidden"] // 64), num_kv_heads=max(1, a["hidden"] // 128),
                      ffn_hidden_size=a["hidden"] * 8 // 3 // 8 * 8, kernels="torch")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a["precision"]]
    ours = impl.startswith("ours")
    zero, _, mode = impl[len("ours-zero"):].partition("-") if ours else ("0", "", "")
    half = max(1, w.world_size // 2)
    spec = MeshSpec(dp=w.world_size, dp_shard=half if mode == "hsdp" else 0,
                    gpus_per_node=half if mode in ("hpz", "zeropp") else 8)
    ctx = w.context(spec) if ours else ParallelContext.single(w.device)
    model = Llama(cfg, ctx).to(w.device)
    model.init_weights(1)
    n_params = sum(p.numel() for p in model.parameters())
    if ours:
        opt = attach([model], ctx, DataParallelConfig(zero=int(zero), precision=a["precision"], lr=1e-3,
                                                      bucket_size=a["bucket_size"],
                                                      **MODES[mode] if mode else {}))
    else:
        model = model.to(dtype)
        if impl == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(model, gradient_as_bucket_view=True)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh(w.device.type, (w.world_size,))
            for blk in model.layers.values():
                fully_shard(blk, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    g = torch.Generator().manual_seed(w.rank)
    tokens = torch.randint(0, cfg.vocab_size, (a["batch"], a["seq"] + 1), generator=g).to(w.device)
    ids, labels, pos = tokens[:, :-1], tokens[:, 1:], torch.arange(a["seq"], device=w.device)
    n_tok = labels.numel() * w.world_size
    times, state = [], {}
    for step in range(2 + a["steps"]):
        if cuda:
            torch.cuda.synchronize()
        if ours:
            ctx.stats.reset()
        t0 = time.perf_counter()
        if ours:
            opt.zero_grad()
            opt.scale_loss(model(ids, pos, labels) / n_tok).backward()
            opt.finish_grad_sync()
            opt.clip_grad_norm(1.0)
            opt.step(1e-3)
        else:
            opt.zero_grad(set_to_none=False)
            (model(ids, pos, labels) / n_tok).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= 2:
            times.append(time.perf_counter() - t0)
        if step == 0:
            if ours:
                state = opt.memory_bytes()
            else:
                params = list(model.parameters())
                state = {"params": sum(_bytes(p) for p in params),
                         "grads": sum(_bytes(p.grad) for p in params if p.grad is not None),
                         "optimizer": sum(_bytes(t) for s in opt.state.values() for t in s.values()
                                          if isinstance(t, torch.Tensor) and t.dim() > 0)}
    peak = torch.cuda.max_memory_allocated() if cuda else _peak_rss() - rss0
    bytes_per_param = torch.finfo(dtype).bits // 8
    if ours:  # the last step's bytes, scalars (norm, skip flag) included
        comm = sum(ctx.stats.bytes.values())
    else:     # logical volumes (comm's convention): DDP all-reduce P; FSDP2 gathers 2P, reduce-scatters P
        comm = n_params * bytes_per_param * (1 if impl == "ddp" else 3)
    return {"ms": statistics.median(times) * 1e3, "state": sum(state.values()), "peak": peak, "n": n_params,
            "comm": comm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--bucket-size", type=int, default=0,
                    help="ours: parameters per gradient bucket (parallel.bucket_size; 0: max(40M, 1M x dp))")
    args = ap.parse_args()
    a = vars(args)
    backend = "nccl" if torch.cuda.device_count() >= args.world else "gloo"
    rows = {}
    for _ in range(args.rounds):
        for impl in args.impls.split(","):
            world = World(args.world, backend)
            try:
                res = world.run(_run, (impl, a), {}, timeout=900)
            except Exception as e:  # report and go on: one failing built-in should not hide the others
                print(f"{impl}: skipped ({str(e).splitlines()[0]})")
                continue
            finally:
                world.close()
            row = {"ms": max(r["ms"] for r in res), "state": res[0]["state"], "peak": max(r["peak"] for r in res),
                   "n": res[0]["n"], "comm": max(r["comm"] for r in res)}
            if impl not in rows or row["ms"] < rows[impl]["ms"]:
                rows[impl] = row
    pair = {impl: "fsdp2" if impl.startswith("ours-zero3") else "ddp" for impl in rows if impl.startswith("ours")}
    n = next(iter(rows.values()))["n"] if rows else 0
    print(f"\n{backend}, world {args.world}, {n / 1e6:.2f}M params, {args.precision}, batch {args.batch}x{args.seq} "
          f"per rank, torch {torch.__version__}")
    sep = "|" if args.markdown else " "
    head = ["impl", "step ms", "comm MB/step", "state MB/rank", "peak MB/rank", "vs", "time ratio", "state ratio"]
    print(sep.join(f"{h:>14}" for h in head))
    if args.markdown:
        print("|".join(["---:"] * len(head)))
    for impl, r in rows.items():
        ref = rows.get(pair.get(impl, ""), None)
        ratio = f"{ref['ms'] / r['ms']:.2f}" if ref else "-"
        sratio = f"{ref['state'] / r['state']:.2f}" if ref else "-"
        print(sep.join(f"{x:>14}" for x in [impl, f"{r['ms']:.1f}", f"{r['comm'] / 2**20:.2f}", f"{r['state'] / 2**20:.1f}",
                                             f"{r['peak'] / 2**20:.1f}", pair.get(impl, "-"), ratio, sratio]))


if __name__ == "__main__":
    main()
