"""Compile every Triton kernel variant the launchers pick, ahead of time, for real GPUs (no GPU needed).

    python benchmarks/kernel_report.py [--arch 80 90 100] [--json] [--quick | --attention]

How the variants are found: benchmarks/kernel_launches.py calls each launcher on small CPU tensors with
`JITFunction.run` replaced by a recorder, once per target arch. Each recorded launch is
compiled with `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`; `cuobjdump -res-usage`
(shipped in Triton's NVIDIA backend) reports registers, stack, local (spill) and shared memory of the cubin,
and the PTX is searched for tensor-core instructions, counted by kind: warpgroup MMA (`wgmma.mma_async`,
sm_90+), `mma.sync` (sm_80+, and on Hopper a dot whose output has fewer than 64 rows) and `tcgen05.mma`
(sm_100); benchmarks/cubin_usage.py reads them. Occupancy is the theoretical CTAs per SM from the register
file, the shared memory and the thread limit of the architecture. --triton VERSION compiles with another Triton
release (benchmarks/triton_wheel.py), e.g. the one the GPU sessions' image ships.

With --json the last stdout line is a JSON list of {"kernel", "variant", "arch", "regs", "spill_bytes",
"shared_bytes", "num_warps", "num_stages", "tensor_core_ops", "wgmma_ops", "mma_sync_ops", "tcgen05_ops",
"ctas_per_sm"} (or "error" for a variant that fails to compile); tensor_core_ops counts every kind.
--attention: the flash-attention kernels alone. Never run under TRITON_INTERPRET=1 (the launchers would pick interpreter
dtypes). Compiles are cached by Triton (~/.triton/cache): a rerun of unchanged kernels takes seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import triton  # noqa: E402

import triton_wheel  # noqa: E402  (benchmarks/, beside this file)
from cubin_usage import ARCH, TC_PATTERNS, occupancy, resources, tools_available, tools_dir  # noqa: E402,F401
from kernel_launches import Launch, launches  # noqa: E402

DOT_KERNELS = {"_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel", "_grouped_mm_kernel",
               "_grouped_mm_wgrad_kernel"}  # kernels with tl.dot


def compile_report(launch: Launch, arch: int, cache: dict | None = None) -> dict[str, Any]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    name = launch.kernel.fn.__name__
    row: dict[str, Any] = {"kernel": name, "variant": launch.variant, "arch": arch}
    key = (name, json.dumps(launch.signature, sort_keys=True), repr(sorted(launch.constexprs.items())),
           repr(sorted(launch.options.items())), arch)
    if cache is not None and key in cache:
        return {**cache[key], "variant": launch.variant}
    try:
        src = ASTSource(fn=launch.kernel, signature=launch.signature, constexprs=launch.constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(launch.options))
        res = resources(compiled.asm["cubin"])
        warps = compiled.metadata.num_warps
        shared = max(res["SHARED"], compiled.metadata.shared)
        counts = {kind: len(re.findall(pattern, compiled.asm["ptx"])) for kind, pattern in TC_PATTERNS.items()}
        row.update(regs=res["REG"], spill_bytes=res["LOCAL"] + res["STACK"], local_bytes=res["LOCAL"],
                   stack_bytes=res["STACK"], shared_bytes=shared, num_warps=warps,
                   num_stages=compiled.metadata.num_stages, tensor_core_ops=sum(counts.values()),
                   wgmma_ops=counts["wgmma_ops"], mma_sync_ops=counts["mma_sync_ops"],
                   tcgen05_ops=counts["tcgen05_ops"],
                   ctas_per_sm=occupancy(arch, res["REG"], shared, warps))
    except Exception as e:  # a variant that does not compile is a row, not a crash
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    if cache is not None:
        cache[key] = row
    return row


def report(archs: list[int], quick: bool = False, attention_only: bool = False) -> list[dict[str, Any]]:
    cache: dict = {}
    return [compile_report(launch, arch, cache) for arch in archs
            for launch in launches(quick, arch, attention_only)]


def _table(rows: list[dict]) -> str:
    head = f"{'kernel':24} {'variant':26} {'sm':>4} {'regs':>5} {'spill':>6} {'smem':>7} {'warps':>5} " \
           f"{'stg':>3} {'wgmma':>5} {'mma':>4} {'tc':>4} {'ctas':>4}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['kernel']:24} {r['variant']:26} {r['arch']:>4} ERROR {r['error']}")
        else:
            lines.append(f"{r['kernel']:24} {r['variant']:26} {r['arch']:>4} {r['regs']:>5} {r['spill_bytes']:>6} "
                         f"{r['shared_bytes']:>7} {r['num_warps']:>5} {r['num_stages']:>3} {r['wgmma_ops']:>5} "
                         f"{r['mma_sync_ops']:>4} {r['tensor_core_ops']:>4} "
                         f"{r['ctas_per_sm']:>4}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90], choices=sorted(ARCH))
    ap.add_argument("--json", action="store_true")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--quick", action="store_true",
                       help="bf16 only: causal attention at every head-dim row, one shape per other kernel (CI)")
    which.add_argument("--attention", action="store_true", help="the flash-attention kernels only")
    ap.add_argument("--planner-table", metavar="PATH",
                    help="also write {arch: {kernel: {variant: {ctas_per_sm, num_warps}}}} for the planner "
                         "(parallel3d/planner/kernel_occupancy.json derates kernels by it)")
    ap.add_argument("--triton", metavar="VERSION",
                    help="compile with this Triton release instead of the installed one (benchmarks/triton_wheel.py; "
                         f"the GPU sessions' image has {triton_wheel.DEVICE_TRITON})")
    args = ap.parse_args(argv)
    if args.triton and args.triton != triton.__version__:
        rest = list(sys.argv[1:] if argv is None else argv)
        rest = [a for i, a in enumerate(rest)  # the same arguments, less the --triton option
                if not a.startswith("--triton") and not (i and rest[i - 1] == "--triton")]
        try:
            return triton_wheel.rerun_under(args.triton, Path(__file__), rest)
        except RuntimeError as e:  # no such release, or no package index in reach
            print(f"error: --triton {args.triton}: {e}", file=sys.stderr)
            return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: unset TRITON_INTERPRET (the launchers would choose interpreter dtypes)", file=sys.stderr)
        return 2
    if not tools_available():
        print(f"error: Triton's NVIDIA backend tools (cuobjdump, ptxas) are missing in {tools_dir()}", file=sys.stderr)
        return 2
    rows = report(args.arch, args.quick, args.attention)
    print(_table(rows))
    if args.planner_table:
        table: dict = {}
        for r in rows:
            if "error" not in r:
                table.setdefault(str(r["arch"]), {}).setdefault(r["kernel"], {})[r["variant"]] = {
                    "ctas_per_sm": r["ctas_per_sm"], "num_warps": r["num_warps"]}
        with open(args.planner_table, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
    if args.json:
        print(json.dumps(rows))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
