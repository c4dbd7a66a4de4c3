"""Our Triton flash attention's tile configurations timed on this GPU, against SDPA.

    python benchmarks/attention_tiles.py [--shape b,s,hq,hk,d] [--causal 0|1]

`_flash_common.launch_config` takes the tiles from one table per arch and head dim (chosen on paper from the
ahead-of-time compile report: tensor cores, no spills); this measures the forward and the backward (dK/dV
+ dQ kernels, both with the candidate) with each candidate in turn, so a choice made on paper can be
checked on the device. Prints one line per candidate as it finishes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton.testing  # noqa: E402
from parallel3d.kernels import flash_attention as fwd_mod  # noqa: E402
from parallel3d.kernels import flash_attention_bwd as bwd_mod  # noqa: E402

FORWARD = [(64, 64, 8, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3),
           (64, 128, 8, 2), (128, 64, 4, 3)]   # (BLOCK_M, BLOCK_N, warps, stages); the first was the d=128
# tile chosen on paper in the first GPU session, the second what it measured fastest
BACKWARD = [(32, 64, 8, 2), (64, 64, 8, 2), (64, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2), (32, 64, 4, 3),
            (64, 32, 4, 2), (16, 64, 4, 2)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="2,4096,32,8,128")
    ap.add_argument("--causal", type=int, default=1)
    args = ap.parse_args()
    b, s, hq, hk, d = (int(x) for x in args.shape.split(","))
    causal = bool(args.causal)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g) for h in (hq, hk, hk))
    flops = 4 * b * hq * s * s * d / (2 if causal else 1)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    sdpa_f = triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
        qt, kt, vt, is_causal=causal, enable_gqa=True))
    out, lse = fwd_mod.flash_attention_forward(q, k, v, causal)
    do = torch.randn_like(out)
    qg, kg, vg = (t.detach().requires_grad_() for t in (qt, kt, vt))
    o_sdpa = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, enable_gqa=True)
    sdpa_b = triton.testing.do_bench(lambda: torch.autograd.grad(o_sdpa, (qg, kg, vg), do.transpose(1, 2),
                                                                 retain_graph=True))
    print(f"shape b{b} s{s} hq{hq} hk{hk} d{d} causal={causal}, {torch.cuda.get_device_name()}: SDPA forward "
          f"{sdpa_f:.3f} ms ({flops / sdpa_f / 1e9:.0f} TFLOP/s), backward {sdpa_b:.3f} ms "
          f"({2.5 * flops / sdpa_b / 1e9:.0f} TFLOP/s)", flush=True)
    paper = fwd_mod.launch_config

    def pinned(cfg):
        return lambda *a, **kw: cfg
    for cfg in FORWARD:
        fwd_mod.launch_config = pinned(cfg)
        try:
            ms = triton.testing.do_bench(lambda: fwd_mod.flash_attention_forward(q, k, v, causal))
            print(f"forward  {cfg}: {ms:.3f} ms, {flops / ms / 1e9:.0f} TFLOP/s, {sdpa_f / ms:.2f}x SDPA", flush=True)
        except Exception as e:  # an out-of-resources config is a row, not the end of the sweep
            print(f"forward  {cfg}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
    fwd_mod.launch_config = paper
    for cfg in BACKWARD:
        bwd_mod.launch_config = pinned(cfg)
        try:
            ms = triton.testing.do_bench(lambda: bwd_mod.flash_attention_backward(do, q, k, v, out, lse, causal))
            print(f"backward {cfg}: {ms:.3f} ms, {2.5 * flops / ms / 1e9:.0f} TFLOP/s, {sdpa_b / ms:.2f}x SDPA",
                  flush=True)
        except Exception as e:
            print(f"backward {cfg}: failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
    bwd_mod.launch_config = paper
    return 0


if __name__ == "__main__":
    sys.exit(main())
