"""Kernel benchmark: our Triton kernels vs torch eager, torch.compile, SDPA (attention) and Liger-Kernel.

    python benchmarks/kernels.py [--ops rmsnorm,rope,flash_attention] [--dtype bf16] [--markdown]

For each op it times forward and forward+backward (triton.testing.do_bench, median ms) and prints the
achieved memory bandwidth (TB/s, for the memory-bound ops: bytes a perfect kernel must move) or compute
rate (TFLOP/s: matmul FLOPs, causal attention counted at half, backward = 2.5x forward as in the
FlashAttention papers; fused linear+CE counts the unfused 6*n*h*v, so a recomputation is not rewarded),
and the ratio other/ours (> 1 means ours is faster); "bwd" is forward+backward less forward (the backward
with the gradient seeds' fill). The fused linear + CE row "ours" is the summed form the model's head runs
(gradients formed in the forward), against compile's unfused head summed the same way. Implementations
that are not installed or fail are listed as skipped. Timings are never asserted anywhere; results go to
benchmarks/RESULTS.md by hand.

Without CUDA it prints a message and exits 0; `--cpu-smoke` instead runs tiny shapes through the torch
paths only, to check the script itself.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Impl = Callable[[], tuple]  # returns (outputs to backprop through, inputs needing grad)


@dataclass
class Case:
    """One op at one shape: impls maps a name to a builder of the forward closure (or None if absent)."""
    op: str
    shape: str
    fwd_amount: float  # bytes or FLOPs for forward
    fwdbwd_amount: float
    unit: str  # "TB/s" or "TFLOP/s"
    impls: dict


def _bench(fn: Callable[[], object], device: str) -> float:
    """Median milliseconds of fn()."""
    if device == "cuda":
        import triton.testing
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def _fwd_bwd(make: Callable[[], Callable], device: str) -> tuple[float, float]:
    """make() -> forward closure f() returning (out tensors, leaf inputs); time f and f + backward."""
    f = make()
    fwd_ms = _bench(lambda: f(), device)

    def step():
        outs, leaves = f()
        outs = [o for o in outs if o is not None and o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        for leaf in leaves:
            leaf.grad = None

    return fwd_ms, _bench(step, device)


def _liger(name: str):
    """Import a Liger-Kernel object by dotted path, or None when Liger is not installed."""
    try:
        module, attr = name.rsplit(".", 1)
        return getattr(__import__(module, fromlist=[attr]), attr)
    except Exception:  # noqa: BLE001 - any import problem means "skip"
        return None


def _setup(device: str, dtype: torch.dtype, tiny: bool) -> dict:
    """What every case builder needs; each op lives in its own function so closures bind its tensors."""
    return dict(device=device, dtype=dtype, tiny=tiny, es=torch.tensor([], dtype=dtype).element_size(),
                compile=(lambda f: f) if tiny else torch.compile, triton=device == "cuda",
                rnd=lambda *s: torch.randn(*s, device=device, dtype=dtype, requires_grad=True))


def _rmsnorm_case(c: dict) -> Case:
    from parallel3d.kernels import rmsnorm as rn
    n, h = (64, 96) if c["tiny"] else (16384, 4096)
    x, w = c["rnd"](n, h), c["rnd"](h)
    ref = c["compile"](rn.rmsnorm_reference)
    impls = {"ours": (lambda: lambda: ((rn.rmsnorm(x, w, 1e-5),), (x, w))) if c["triton"] else None,
             "eager": lambda: lambda: ((rn.rmsnorm_reference(x, w, 1e-5),), (x, w)),
             "compile": lambda: lambda: ((ref(x, w, 1e-5),), (x, w))}
    liger = _liger("liger_kernel.transformers.LigerRMSNorm")
    if liger is not None and c["triton"]:
        mod = liger(h, eps=1e-5).to(device=c["device"], dtype=c["dtype"])
        impls["liger"] = lambda: lambda: ((mod(x),), (x, mod.weight))
    return Case("rmsnorm", f"{n}x{h}", (2 * n * h + h) * c["es"], 5 * n * h * c["es"], "TB/s", impls)


def _swiglu_case(c: dict) -> Case:
    from parallel3d.kernels import swiglu as sw
    n, f = (64, 160) if c["tiny"] else (16384, 14336)
    g, u = c["rnd"](n, f), c["rnd"](n, f)
    ref = c["compile"](sw.swiglu_reference)
    impls = {"ours": (lambda: lambda: ((sw.swiglu(g, u),), (g, u))) if c["triton"] else None,
             "eager": lambda: lambda: ((sw.swiglu_reference(g, u),), (g, u)),
             "compile": lambda: lambda: ((ref(g, u),), (g, u))}
    liger = _liger("liger_kernel.ops.swiglu.LigerSiLUMulFunction")
    if liger is not None and c["triton"]:
        impls["liger"] = lambda: lambda: ((liger.apply(g, u),), (g, u))
    return Case("swiglu", f"{n}x{f}", 3 * n * f * c["es"], 8 * n * f * c["es"], "TB/s", impls)


def _rope_case(c: dict) -> Case:
    from parallel3d.kernels import rope as rp
    b, s, hq, hk, d = (1, 32, 4, 2, 16) if c["tiny"] else (4, 4096, 32, 8, 128)
    q, k = c["rnd"](b, s, hq, d), c["rnd"](b, s, hk, d)
    cos, sin = rp.rope_cos_sin(torch.arange(s, device=c["device"]), rp.rope_inv_freq(d, 500000.0))
    ref = c["compile"](rp.rope_reference)
    impls = {"ours": (lambda: lambda: (rp.rope(q, k, cos, sin), (q, k))) if c["triton"] else None,
             "eager": lambda: lambda: (rp.rope_reference(q, k, cos, sin), (q, k)),
             "compile": lambda: lambda: (ref(q, k, cos, sin), (q, k))}
    liger = _liger("liger_kernel.transformers.liger_rotary_pos_emb")
    if liger is not None and c["triton"]:  # Liger wants (b, h, s, d)
        qt = q.detach().transpose(1, 2).contiguous().requires_grad_()
        kt = k.detach().transpose(1, 2).contiguous().requires_grad_()
        c2, s2 = cos[None].to(c["dtype"]), sin[None].to(c["dtype"])
        impls["liger"] = lambda: lambda: (liger(qt, kt, c2, s2), (qt, kt))
    qk = b * s * (hq + hk) * d * c["es"]
    return Case("rope", f"b{b} s{s} hq{hq} hk{hk} d{d}", 2 * qk, 4 * qk, "TB/s", impls)


def _cross_entropy_case(c: dict) -> Case:
    from parallel3d.kernels import cross_entropy as ce
    n, v = (64, 300) if c["tiny"] else (8192, 128256)
    logits, tgt = c["rnd"](n, v), torch.randint(0, v, (n,), device=c["device"])
    ref = c["compile"](ce.cross_entropy_reference)
    impls = {"ours": (lambda: lambda: ((ce.cross_entropy(logits, tgt),), (logits,))) if c["triton"] else None,
             "eager": lambda: lambda: ((ce.cross_entropy_reference(logits, tgt),), (logits,)),
             "compile": lambda: lambda: ((ref(logits, tgt),), (logits,))}
    liger = _liger("liger_kernel.transformers.LigerCrossEntropyLoss")
    if liger is not None and c["triton"]:  # Liger computes the gradient inside its forward (in place)
        loss_fn = liger(reduction="sum")
        impls["liger"] = lambda: lambda: ((loss_fn(logits, tgt),), (logits,))
    return Case("cross_entropy", f"{n}x{v}", n * v * c["es"], 3 * n * v * c["es"], "TB/s", impls)


def _fused_linear_ce_case(c: dict) -> Case:
    from parallel3d.kernels import fused_linear_cross_entropy as fl
    n, h, v = (64, 32, 300) if c["tiny"] else (8192, 4096, 128256)
    hid, wt, tgt = c["rnd"](n, h), c["rnd"](v, h), torch.randint(0, v, (n,), device=c["device"])
    chunk = 16 if c["tiny"] else None  # None: head_chunk_rows, what the model's head takes (2048 here)

    def summed(h, w, t):  # the unfused head as the model reduces it: the sum of the token losses
        return fl.fused_linear_cross_entropy_reference(h, w, t).sum()
    ref = c["compile"](summed)
    impls = {"ours": lambda: lambda: ((fl.fused_linear_cross_entropy(hid, wt, tgt, -100, chunk, c["triton"],
                                                                     reduction="sum"),), (hid, wt)),
             "ours-per-token": lambda: lambda: ((fl.fused_linear_cross_entropy(hid, wt, tgt, -100, chunk,
                                                                               c["triton"]),), (hid, wt)),
             "eager": lambda: lambda: ((summed(hid, wt, tgt),), (hid, wt)),
             "compile": lambda: lambda: ((ref(hid, wt, tgt),), (hid, wt))}
    liger = _liger("liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss")
    if liger is not None and c["triton"]:
        loss_fn = liger(reduction="sum")
        impls["liger"] = lambda: lambda: ((loss_fn(wt, hid, tgt),), (hid, wt))
    return Case("fused_linear_ce", f"n{n} h{h} v{v}", 2 * n * h * v, 6 * n * h * v, "TFLOP/s", impls)


def _attention_case(c: dict) -> Case:
    from parallel3d.kernels import flash_attention as fa
    b, s, hq, hk, d = (1, 48, 4, 2, 16) if c["tiny"] else (2, 4096, 32, 8, 128)
    q, k, v = c["rnd"](b, s, hq, d), c["rnd"](b, s, hk, d), c["rnd"](b, s, hk, d)
    ref = c["compile"](fa.attention_reference)
    ours = lambda: lambda: ((fa.flash_attention(q, k, v, True)[0],), (q, k, v))  # noqa: E731
    impls = {"ours": ours if c["triton"] else None,
             "sdpa": lambda: lambda: ((fa.sdpa_attention(q, k, v, True),), (q, k, v)),
             "eager": lambda: lambda: ((fa.attention_reference(q, k, v, True)[0],), (q, k, v)),
             "compile": lambda: lambda: ((ref(q, k, v, True)[0],), (q, k, v))}
    flops = 4 * b * hq * s * s * d / 2
    return Case("flash_attention", f"b{b} s{s} hq{hq} hk{hk} d{d} causal", flops, 3.5 * flops, "TFLOP/s", impls)


def _cases(device: str, dtype: torch.dtype, tiny: bool, ops: set) -> list[Case]:
    """Build only the requested cases (each allocates its tensors up front)."""
    builders = {"rmsnorm": _rmsnorm_case, "swiglu": _swiglu_case, "rope": _rope_case,
                "cross_entropy": _cross_entropy_case, "fused_linear_ce": _fused_linear_ce_case,
                "flash_attention": _attention_case}
    unknown = ops - set(builders)
    if unknown:
        raise SystemExit(f"unknown --ops {sorted(unknown)}; choose from {sorted(builders)}")
    c = _setup(device, dtype, tiny)
    return [build(c) for name, build in builders.items() if not ops or name in ops]


def _run(cases: list[Case], device: str, markdown: bool) -> None:
    sep = " | " if markdown else "  "
    header = ["op", "shape", "impl", "fwd ms", "fwd+bwd ms", "fwd rate", "fwd+bwd rate", "fwd x", "f+b x",
              "bwd ms", "bwd x"]
    print(("| " if markdown else "") + sep.join(header) + (" |" if markdown else ""))
    if markdown:
        print("|" + "---|" * len(header))
    for case in cases:
        results = {}
        for name, make in case.impls.items():
            if make is None:
                continue
            try:
                results[name] = _fwd_bwd(make, device)
            except Exception as exc:  # noqa: BLE001 - report and continue with the other impls
                print(f"# {case.op}/{name} skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
            if device == "cuda":
                torch.cuda.empty_cache()
        base = results.get("ours")
        for name, (fwd, fb) in results.items():
            scale = 1e-12 / 1e-3
            row = [case.op, case.shape, name, f"{fwd:.3f}", f"{fb:.3f}",
                   f"{case.fwd_amount / fwd * scale:.2f} {case.unit}",
                   f"{case.fwdbwd_amount / fb * scale:.2f} {case.unit}",
                   f"{fwd / base[0]:.2f}" if base else "-", f"{fb / base[1]:.2f}" if base else "-",
                   f"{fb - fwd:.3f}", f"{(fb - fwd) / (base[1] - base[0]):.2f}" if base and base[1] > base[0] else "-"]
            print(("| " if markdown else "") + sep.join(row) + (" |" if markdown else ""))


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="", help="comma list of: rmsnorm, swiglu, rope, cross_entropy, "
                        "fused_linear_ce, flash_attention (default: all)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--markdown", action="store_true", help="print a markdown table for RESULTS.md")
    parser.add_argument("--cpu-smoke", action="store_true", help="no GPU: tiny shapes, torch paths only")
    args = parser.parse_args(argv)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    ops = set(filter(None, args.ops.split(",")))
    if torch.cuda.is_available():
        print(f"# device: {torch.cuda.get_device_name()}, torch {torch.__version__}, dtype {args.dtype}; "
              "x = other time / ours (> 1: ours faster)")
        _run(_cases("cuda", dtype, False, ops), "cuda", args.markdown)
    elif args.cpu_smoke:
        print("# CPU smoke run: tiny shapes, torch eager paths only; timings are meaningless")
        _run(_cases("cpu", torch.float32, True, ops), "cpu", args.markdown)
    else:
        print("benchmarks/kernels.py: no CUDA GPU found; the Triton kernels are benchmarked on GPUs only. "
              "Nothing to do (use --cpu-smoke to exercise the script on tiny CPU shapes).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
