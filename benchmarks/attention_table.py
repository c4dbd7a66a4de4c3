"""Attention forward and backward on one GPU, every shape of issue 49 side by side: ours against each of
SDPA's backends, FlexAttention and, where installed, flash-attn; markdown tables ready for RESULTS.md.

    python benchmarks/attention_table.py [--out PATH] [--budget-s 480] [--only causal|docs] [--cpu-tiny]

Causal rows (bf16, GQA 32/8 and 64/8, head dim 64 and 128, b x s from 8K to 64K tokens): ours
(`ops.flash_attention`, what `model.attention=triton` runs), SDPA with one backend at a time (flash, efficient,
cudnn; a backend that refuses GQA runs on kv heads expanded beforehand, marked `x`), the CP block that
returns the lse (`dispatch.attention_with_lse`, auto), flash-attn's `flash_attn_func`. Ratio = the fastest
SDPA backend's time / ours (> 1: ours is faster). Packed-document rows (documents of random length around a
mean): ours with document ids, FlexAttention with a document block mask (compiled, what TorchTitan runs),
SDPA document by document, `auto`'s own choice today (`dispatch.attention`: flash-attn's varlen entry when
installed, else block-wise SDPA with a mask) and flash-attn's varlen entry. Ratios against FlexAttention
and SDPA per document. Backward is timed alone (autograd.grad of a kept forward); FLOPs count the visible
pairs (forward 4 * hq * d per pair, backward 2.5x). Each implementation's forward is checked against the
first that ran (max abs difference in the last column): a wrong kernel's rate shows beside its error.

Rows print as they finish (documents first); the tables print at the end and are rewritten to --out after
each shape, and once --budget-s seconds have passed the remaining shapes are skipped (named in the
output). --cpu-tiny: one tiny causal and one document shape on the CPU with two timing repeats, to check
the script's paths without a GPU (SDPA's CUDA backends are absent there; ours needs TRITON_INTERPRET=1).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

Fn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]   # (b, s, h, d) in and out
# (b, s, hq, hk, d): GQA 32/8 and 64/8, head dim 128 and 64, 8K / 32K / 64K tokens per call
CAUSAL_SHAPES = [(b, s, hq, 8, d) for d in (128, 64) for hq in (32, 64) for b, s in ((1, 8192), (4, 8192), (8, 8192))]
CAUSAL_SHAPES += [(1, 32768, 32, 8, 128), (1, 65536, 32, 8, 128)]   # long sequences: one document of 32K / 64K
# (b, s, hq, hk, d, mean document length): packed documents
DOC_SHAPES = [(4, 8192, 32, 8, 128, 1024), (4, 8192, 32, 8, 128, 4096), (8, 8192, 64, 8, 128, 2048),
              (4, 8192, 32, 8, 64, 1024)]
TINY_CAUSAL, TINY_DOCS = [(1, 64, 4, 2, 16)], [(1, 64, 4, 2, 16, 16)]


def bench_ms(fn: Callable[[], object], device: torch.device, tiny: bool) -> float:
    """Mean milliseconds of fn (triton.testing.do_bench on CUDA; a few timed calls on the CPU)."""
    if device.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=60)
    fn()
    t0 = time.perf_counter()
    for _ in range(2 if tiny else 5):
        fn()
    return (time.perf_counter() - t0) / (2 if tiny else 5) * 1e3


def bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (b, s, h, d) <-> (b, h, s, d)


def expand(x: torch.Tensor, hq: int) -> torch.Tensor:
    return x.repeat_interleave(hq // x.shape[2], dim=2)  # (b, s, hk, d) -> (b, s, hq, d)


def sdpa_with(backend) -> Fn:
    """SDPA on one backend only; GQA native (enable_gqa)."""
    from torch.nn.attention import sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel([backend]):
            return bhsd(F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=True,
                                                       enable_gqa=q.shape[2] != k.shape[2]))
    return run


def causal_impls(device: torch.device) -> dict[str, Fn]:
    from parallel3d.kernels import dispatch, ops
    from parallel3d.kernels.attention_backend import flash_attn_available

    impls: dict[str, Fn] = {"ours": lambda q, k, v: ops.flash_attention(q, k, v, True)[0]}
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend
        for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                              ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            impls[f"sdpa-{name}"] = sdpa_with(backend)
    else:
        impls["sdpa-cpu"] = lambda q, k, v: bhsd(F.scaled_dot_product_attention(
            bhsd(q), bhsd(k), bhsd(v), is_causal=True, enable_gqa=True))
    impls["cp-block (auto)"] = lambda q, k, v: dispatch.attention_with_lse(q, k, v, True, None, "auto")[0]
    if flash_attn_available() and device.type == "cuda":
        from flash_attn import flash_attn_func
        impls["flash-attn"] = lambda q, k, v: flash_attn_func(q, k, v, causal=True)
    return impls


def documents(b: int, s: int, mean: int, seed: int) -> torch.Tensor:
    """(b, s) int32 document ids, nondecreasing, lengths uniform in [mean / 4, 7 mean / 4]."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        ids, doc = [], 0
        while len(ids) < s:
            n = int(torch.randint(max(mean // 4, 1), max(7 * mean // 4, 2), (1,), generator=g))
            ids += [doc] * n
            doc += 1
        rows.append(ids[:s])
    return torch.tensor(rows, dtype=torch.int32)


def spans(doc_host: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per batch row, the [start, end) of each document."""
    out = []
    for row in doc_host.tolist():
        cuts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]] + [len(row)]
        out.append(list(zip(cuts[:-1], cuts[1:])))
    return out


def doc_impls(doc: torch.Tensor, device: torch.device, tiny: bool) -> dict[str, Fn]:
    from parallel3d.kernels import dispatch
    from parallel3d.kernels.attention_backend import flash_attn_available
    from parallel3d.kernels.flash_attention import flash_attention

    host = doc.cpu()
    doc_dev = doc.to(device)
    b, s = doc.shape
    impls: dict[str, Fn] = {"ours": lambda q, k, v: flash_attention(q, k, v, True, q_doc=doc_dev, k_doc=doc_dev)[0]}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def same_doc_causal(bi, h, qi, ki):
            return (doc_dev[bi, qi] == doc_dev[bi, ki]) & (qi >= ki)
        block_mask = create_block_mask(same_doc_causal, B=b, H=None, Q_LEN=s, KV_LEN=s, device=device)
        flex = flex_attention if tiny else torch.compile(flex_attention, dynamic=False)
        impls["flex (doc block mask)"] = lambda q, k, v: bhsd(flex(bhsd(q), bhsd(k), bhsd(v), block_mask=block_mask,
                                                                   enable_gqa=q.shape[2] != k.shape[2]))
    except Exception as e:  # an old torch: the row says why
        print(f"flex attention unavailable: {type(e).__name__}: {e}", flush=True)
    per_doc = spans(host)

    def sdpa_per_document(q, k, v):
        outs = [bhsd(F.scaled_dot_product_attention(bhsd(q[bi:bi + 1, a:e]), bhsd(k[bi:bi + 1, a:e]),
                                                    bhsd(v[bi:bi + 1, a:e]), is_causal=True,
                                                    enable_gqa=q.shape[2] != k.shape[2]))
                for bi in range(b) for a, e in per_doc[bi]]
        return torch.cat(outs, dim=1).reshape(q.shape)  # documents in order, row after row
    impls["sdpa per document"] = sdpa_per_document
    impls["auto today"] = lambda q, k, v: dispatch.attention(q, k, v, True, None, "auto", doc_ids=doc_dev,
                                                             doc_ids_host=host)
    if flash_attn_available() and device.type == "cuda":
        from parallel3d.kernels.varlen_attention import flash_attn_varlen
        impls["flash-attn varlen"] = lambda q, k, v: flash_attn_varlen(q, k, v, host)
    return impls


def time_impl(fn: Fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, device: torch.device, tiny: bool
              ) -> tuple[float, float, torch.Tensor, bool]:
    """(forward ms, backward ms, the forward's output, whether kv heads were expanded to run it)."""
    expanded = False
    try:
        out = fn(q, k, v)
    except RuntimeError:  # a backend refusing GQA: expanded kv heads (the expansion is not timed)
        k, v = (expand(t.detach(), q.shape[2]).requires_grad_() for t in (k, v))
        out, expanded = fn(q, k, v), True
    fwd = bench_ms(lambda: fn(q, k, v), device, tiny)
    dout = torch.randn_like(out)
    bwd = bench_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), device, tiny)
    return fwd, bwd, out.detach(), expanded


def causal_pairs(s: int) -> int:
    return s * (s + 1) // 2


def run_rows(kind: str, shapes: list, device: torch.device, tiny: bool, deadline: float, rows: list[dict],
             save: Callable[[], None]) -> None:
    """Time every implementation at each shape into `rows`; `save` after each shape (a killed run keeps
    what it measured)."""
    from parallel3d.kernels.attention_backend import select_attention

    for shape in shapes:
        b, s, hq, hk, d = shape[:5]
        name = f"b{b} s{s} hq{hq} hk{hk} d{d}" + (f" docs~{shape[5]}" if kind == "docs" else "")
        if time.monotonic() > deadline:
            print(f"skipped (budget): {kind} {name}", flush=True)
            continue
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device=device, dtype=torch.bfloat16 if not tiny else torch.float32,
                               generator=g).requires_grad_() for h in (hq, hk, hk))
        if kind == "docs":
            doc = documents(b, s, shape[5], seed=1)
            pairs = sum(causal_pairs(e - a) for row in spans(doc) for a, e in row)
            impls = doc_impls(doc, device, tiny)
        else:
            pairs, impls = b * causal_pairs(s), causal_impls(device)
        flops = 4 * hq * d * pairs
        auto = select_attention("auto", q, need_lse=False)  # dispatch.attention's choice on this device
        if kind == "docs":
            auto = {"flash_attn": "flash-attn varlen", "triton": "ours"}.get(auto, "block-wise sdpa")
        row = {"kind": kind, "shape": name, "auto": auto, "impls": {}}
        first = None
        for impl, fn in impls.items():
            try:
                fwd, bwd, out, expanded = time_impl(fn, q, k, v, device, tiny)
            except Exception as e:  # a backend that cannot run this shape is a row, not the end
                print(f"{kind} {name} {impl}: failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
                continue
            first = out if first is None else first
            diff = (out.float() - first.float()).abs().max().item()
            row["impls"][impl] = dict(fwd=fwd, bwd=bwd, expanded=expanded, diff=diff,
                                      fwd_tf=flops / fwd / 1e9, bwd_tf=2.5 * flops / bwd / 1e9)
            print(f"{kind} {name} {impl}{' x' if expanded else ''}: forward {fwd:.3f} ms "
                  f"({flops / fwd / 1e9:.0f} TFLOP/s), backward {bwd:.3f} ms ({2.5 * flops / bwd / 1e9:.0f} TFLOP/s), "
                  f"max |out - first| {diff:.2e}", flush=True)
            del out
        rows.append(row)
        save()
        del q, k, v, impls
        if device.type == "cuda":
            torch.cuda.empty_cache()


def _fastest(impls: dict, prefix: str, key: str) -> Optional[tuple[str, dict]]:
    found = [(n, r) for n, r in impls.items() if n.startswith(prefix)]
    return min(found, key=lambda nr: nr[1][key]) if found else None


def _cell(r: Optional[dict], key: str) -> str:
    return "-" if r is None else f"{r[key]:.3f} ({r[key + '_tf']:.0f})" + (" x" if r.get("expanded") else "")


def tables(rows: list[dict]) -> str:
    """Markdown: per shape ms (TFLOP/s) of each implementation, and ours against the references."""
    out = []
    for kind, refs in (("docs", ("flex", "sdpa per document", "auto today")), ("causal", ("sdpa",))):
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        names = list(dict.fromkeys(n for r in mine for n in r["impls"]))
        out.append(f"\n{kind}: forward / backward ms (TFLOP/s); x = kv heads expanded for a backend without GQA\n")
        out.append("| shape | auto takes | " + " | ".join(names) + " |")
        out.append("|---|---|" + "---|" * len(names))
        for r in mine:
            cells = [f"{_cell(r['impls'].get(n), 'fwd')} / {_cell(r['impls'].get(n), 'bwd')}" for n in names]
            out.append(f"| {r['shape']} | {r['auto']} | " + " | ".join(cells) + " |")
        out.append(f"\n{kind}: ours' speed as a multiple of the reference's (its time / ours; > 1: ours faster)\n")
        heads = [f"vs {'fastest SDPA backend' if ref == 'sdpa' else ref} fwd / bwd" for ref in refs]
        out.append("| shape | " + " | ".join(heads) + " | max abs diff of outputs |")
        out.append("|---|" + "---|" * (len(refs) + 1))
        for r in mine:
            ours, cells = r["impls"].get("ours"), []
            for ref in refs:
                f, bw = _fastest(r["impls"], ref, "fwd"), _fastest(r["impls"], ref, "bwd")
                if ours is None or f is None or bw is None:
                    cells.append("-")
                else:
                    cells.append(f"{f[1]['fwd'] / ours['fwd']:.2f} ({f[0]}) / "
                                 f"{bw[1]['bwd'] / ours['bwd']:.2f} ({bw[0]})")
            diff = max((i["diff"] for i in r["impls"].values()), default=float("nan"))
            out.append(f"| {r['shape']} | " + " | ".join(cells) + f" | {diff:.1e} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="also write the tables (markdown) to this file")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip the rows left after this many seconds")
    ap.add_argument("--only", choices=("causal", "docs"))
    ap.add_argument("--cpu-tiny", action="store_true", help="tiny shapes on the CPU: the script's paths, no rates")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.cpu_tiny else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (--cpu-tiny checks the script on a CPU)", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}, torch {torch.__version__}", flush=True)
    rows: list[dict] = []

    def save() -> None:
        if args.out:
            Path(args.out).write_text(f"device {name}, torch {torch.__version__}\n{tables(rows)}\n")
    if args.only in (None, "docs"):  # first: FlexAttention's rows are what the documents case is judged by
        run_rows("docs", TINY_DOCS if args.cpu_tiny else DOC_SHAPES, device, args.cpu_tiny, deadline, rows, save)
    if args.only in (None, "causal"):
        run_rows("causal", TINY_CAUSAL if args.cpu_tiny else CAUSAL_SHAPES, device, args.cpu_tiny, deadline, rows,
                 save)
    print(tables(rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
