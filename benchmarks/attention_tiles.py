"""Our Triton flash attention's launch choices timed on this GPU, kernel by kernel, against SDPA.

    python benchmarks/attention_tiles.py [--head-dims 128 64] [--budget-s 400] [--out PATH] [--cpu-tiny]

`_flash_common.launch_config` takes each kernel's tile (BLOCK_M, BLOCK_N, warps, stages) from one table per
arch and head dim, `_flash_common.TMA_16BIT` says where the tiles load through TMA tensor descriptors and
`KEY_ROWS_16BIT` where dK/dV runs its key-rows form; all were chosen on paper from the ahead-of-time compile
report. This times every candidate of one kernel (forward, dK/dV, dQ) with the pointer loads and with TMA
(dK/dV: in both forms where the key tile has 64 rows or more), the other kernels keeping their table rows, at
b2 s4096 hq32 hk8 causal bf16 per head dim, so the table can be replaced by what ran fastest: the table's
own row comes first, then the H200's earlier winners, then the rest. A forward candidate is timed alone;
a dK/dV or dQ candidate as the whole backward (delta + dK/dV + dQ; only the candidate's kernel differs).
Each candidate's output (forward) or gradients (backward) are checked against SDPA's: one off by more than
WRONG is printed as such and never chosen. Prints a line per candidate as it finishes (round robin over the
kernels, so a short budget still times each kernel's first choices) and, at the end (or when --budget-s has
passed), the fastest choice per kernel beside the table's, as markdown (also written to --out). --cpu-tiny
runs the paths on a tiny CPU shape.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from parallel3d.kernels import _flash_common as common  # noqa: E402
from parallel3d.kernels.flash_attention import flash_attention_backward, flash_attention_forward  # noqa: E402

# candidates after the table's row, per (kernel, head-dim class): the first of each d=128 list is what the
# first H200 session measured fastest on the kernel of its day (RESULTS.md, "Flash-attention tiles")
CANDIDATES = {
    ("fwd", 128): [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 3), (128, 32, 8, 3), (128, 128, 8, 3)],
    ("dkdv", 128): [(64, 64, 4, 2), (64, 64, 8, 2), (64, 32, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2)],
    ("dq", 128): [(64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (128, 32, 8, 2)],
    ("fwd", 64): [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3)],
    ("dkdv", 64): [(64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 2)],
    ("dq", 64): [(64, 64, 4, 2), (128, 64, 8, 2), (64, 16, 4, 2)],
}


# A candidate whose output or gradients differ from SDPA's by more than this share of the largest value computes
# something else (a bf16 run differs by ~1e-3): it is reported WRONG and never chosen, however fast.
WRONG = 0.05


def relative_error(got: tuple, want: tuple) -> float:
    """Largest |got - want| over the largest |want|, the worst of the tensors."""
    return max(((g.float() - w.float()).abs().max() / w.float().abs().max().clamp_min(1e-12)).item()
               for g, w in zip(got, want))


def time_ms(fn, device: str = "cuda") -> float:
    """Median ms of fn (triton.testing.do_bench); on the CPU (--cpu-tiny) one call: the interpreter's times
    say nothing of a GPU's, and the run only shows that each path works (each extra call cost a second)."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=50)


def sweep(d: int, deadline: float, rows: list[dict], device: str = "cuda", shape: tuple = (2, 4096, 32, 8)) -> None:
    """Time the candidates of each kernel at head dim d (shape: b, s, hq, hk) until `deadline`, into rows."""
    b, s, hq, hk = shape
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16, generator=g) for h in (hq, hk, hk))
    time_ms_here = lambda fn: time_ms(fn, device)  # noqa: E731
    flops = 4 * b * hq * s * s * d / 2  # causal: half the pairs
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    sdpa_f = time_ms_here(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                             enable_gqa=True))
    qg, kg, vg = (t.detach().requires_grad_() for t in (qt, kt, vt))
    o_sdpa = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
    out, lse = flash_attention_forward(q, k, v, True)
    do = torch.randn_like(out)
    sdpa_b = time_ms_here(lambda: torch.autograd.grad(o_sdpa, (qg, kg, vg), do.transpose(1, 2), retain_graph=True))
    # what every candidate must compute, in (b, s, h, d): SDPA's output and gradients
    want = {"fwd": (o_sdpa.detach().transpose(1, 2),),
            "bwd": tuple(g.transpose(1, 2) for g in torch.autograd.grad(o_sdpa, (qg, kg, vg), do.transpose(1, 2)))}
    print(f"d{d}: SDPA forward {sdpa_f:.3f} ms ({flops / sdpa_f / 1e9:.0f} TFLOP/s), backward {sdpa_b:.3f} ms "
          f"({2.5 * flops / sdpa_b / 1e9:.0f} TFLOP/s)", flush=True)
    table, tma_table, key_rows_table = dict(common.TILES_16BIT), common.TMA_16BIT, common.KEY_ROWS_16BIT
    arch, dclass = common.tile_arch(common.device_capability(q.device)), common.head_dim_class(d)
    own_key_rows = (arch, dclass) in key_rows_table
    plans = {}  # kernel -> its (tile, tma, key rows) in order: the table's tile first, then the candidates
    for kernel in ("fwd", "dkdv", "dq"):
        own = table[(kernel, arch, dclass)]
        plans[kernel] = [(t, m, r) for t in [own] + [t for t in CANDIDATES[(kernel, dclass)] if t != own]
                         for m in (False, True) for r in _forms(kernel, t, own_key_rows)]
    # round robin over the kernels, so a short budget still times every kernel's first choices
    turns = [(kernel, plan[i]) for i in range(max(map(len, plans.values())))
             for kernel, plan in plans.items() if i < len(plan)]
    for kernel, (tile, tma, key_rows) in turns:
        own = table[(kernel, arch, dclass)]
        if time.monotonic() > deadline:
            return
        common.TILES_16BIT[(kernel, arch, dclass)] = tile
        others = {(kk, c) for kk, c in tma_table if kk != kernel}
        common.TMA_16BIT = frozenset(others | ({(kernel, dclass)} if tma else set()))
        common.KEY_ROWS_16BIT = frozenset(key_rows_table - {(arch, dclass)} | ({(arch, dclass)} if key_rows
                                                                              else set()))
        row = dict(d=d, kernel=kernel, tile=tile, tma=tma, key_rows=key_rows,
                   table=tile == own and tma == ((kernel, dclass) in tma_table) and key_rows == own_key_rows)
        try:
            if kernel == "fwd":
                run = lambda: flash_attention_forward(q, k, v, True)[:1]  # noqa: E731
                ms = time_ms_here(run)
                row.update(ms=ms, tflops=flops / ms / 1e9, x_sdpa=sdpa_f / ms)
            else:
                run = lambda: flash_attention_backward(do, q, k, v, out, lse, True)  # noqa: E731
                ms = time_ms_here(run)
                row.update(ms=ms, tflops=2.5 * flops / ms / 1e9, x_sdpa=sdpa_b / ms)
            row["error"] = relative_error(run(), want["fwd" if kernel == "fwd" else "bwd"])
            wrong = f", WRONG: {row['error']:.3g} of the largest value off SDPA's" if row["error"] > WRONG else ""
            print(f"d{d} {kernel:4s} {_name(row)}: {ms:.3f} ms, {row['tflops']:.0f} "
                  f"TFLOP/s, {row['x_sdpa']:.2f}x SDPA{wrong}", flush=True)
        except Exception as e:  # an out-of-resources config is a row, not the end of the sweep
            row["failed"] = f"{type(e).__name__}: {str(e)[:120]}"
            print(f"d{d} {kernel:4s} {_name(row)}: failed: {row['failed']}", flush=True)
        finally:
            common.TILES_16BIT.clear()
            common.TILES_16BIT.update(table)
            common.TMA_16BIT, common.KEY_ROWS_16BIT = tma_table, key_rows_table
        rows.append(row)


def _forms(kernel: str, tile: tuple, own: bool) -> tuple:
    """dK/dV's forms worth timing for a tile: the table's first, the key-rows one only with >= 64 key rows."""
    if kernel != "dkdv":
        return (False,)
    return (own, not own) if tile[1] >= 64 else (own,)


def _name(row: dict) -> str:
    return f"{row['tile']} {'tma' if row['tma'] else 'ptr'}{' key rows' if row.get('key_rows') else ''}"


def summary(rows: list[dict]) -> str:
    """Per (head dim, kernel): the table's choice and the fastest one measured."""
    lines = ["| d | kernel | table's choice | ms | x SDPA | fastest | ms | x SDPA | fastest / table |",
             "|---:|---|---|---:|---:|---|---:|---:|---:|"]
    for d in sorted({r["d"] for r in rows}, reverse=True):
        for kernel in ("fwd", "dkdv", "dq"):
            ran = [r for r in rows if r["d"] == d and r["kernel"] == kernel and "ms" in r and r["error"] <= WRONG]
            if not ran:
                continue
            best = min(ran, key=lambda r: r["ms"])
            own = next((r for r in ran if r["table"]), None)
            left = f"{_name(own)} | {own['ms']:.3f} | {own['x_sdpa']:.2f}" if own else "not timed | | "
            ratio = f"{own['ms'] / best['ms']:.2f}x" if own else ""
            lines.append(f"| {d} | {kernel} | {left} | {_name(best)} | {best['ms']:.3f} | {best['x_sdpa']:.2f} | "
                         f"{ratio} |")
    return "\n".join(lines)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--cpu-tiny", action="store_true",
                    help="b1 s64 hq4 hk2 on the CPU (TRITON_INTERPRET=1): the script's paths, not a timing")
    args = ap.parse_args(argv)
    device, shape = ("cpu", (1, 64, 4, 2)) if args.cpu_tiny else ("cuda", (2, 4096, 32, 8))
    name = "CPU" if args.cpu_tiny else torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}", flush=True)
    deadline, rows = time.monotonic() + args.budget_s, []
    for d in args.head_dims:
        sweep(d, deadline, rows, device, shape)
    if time.monotonic() > deadline:
        print(f"budget of {args.budget_s:.0f} s spent: the rows above are all that ran", flush=True)
    text = summary(rows)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
