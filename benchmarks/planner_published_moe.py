"""planner_published.py's `moe` group: MoE runs at their published layouts, each beside its published figure.

  Qwen3-235B-A22B  Megatron-Core's published rows on 256 H100 (bf16, seq 4096, global batch 2048):
                   TP2 EP32 PP8 VPP4 with the DeepEP dispatcher, 245 TFLOP/s per GPU, and 276 with the 1F1B
                   all-to-all overlap; TP2 EP8 PP32 VPP3 with the plain all-to-all dispatcher, 200. EP32 at
                   DP16 is only possible with parallel folding (EP over TP x DP, parallel.etp=1).
  DeepSeek-V3      the report's layout on 2,048 H800 (PP16, EP64, ZeRO-1 DP, DualPipe; FP8): 180K H800 GPU-hours
                   per trillion tokens, i.e. 1e12 / (180e3 * 3600) = 1,543 tokens/s per GPU. Planned in bf16
                   on the H100 (an H800 has its compute and less NVLink: 400 GB/s both ways against 900), with
                   the preset's 1F1B and with our DualPipe-V, so every row reruns as the one command it prints.

What our run does differently, printed with each row: our dispatcher is a plain uneven all-to-all (no DeepEP,
no fused permute), so Megatron's all-to-all row (200) is the comparable one; the DeepEP rows show what a
fused dispatcher buys. The 276 row's all-to-all overlap is planned with ours (`parallel.ep_overlap=true`:
interleaved 1F1B's back-to-back F/B pairs run in turns, pipeline/pairing.py), as is DualPipe-V's pairs.
Routing is planned balanced (`--moe-load 1`).

`moe_load` (the `moe-load` group, issue 50 item 5) plans each distinct layout above dropless at routing loads
LOADS: the busiest EP rank's routed rows as a multiple of the balanced share, which the step waits for at
every exchange and whose received rows set the peak. MEASURED is the load this project has measured: the
busiest of two EP ranks in llama_100m's dropless runs (benchmarks/RESULTS.md, seventh session: 1.16-1.43 per
step, median 1.28; tiny's runs 1.06-1.09). Those are tiny models at EP 2; the busiest of 8-64 ranks of a
trained router is not measured here, so the sweep lets a reader take their own load.
"""
from __future__ import annotations

from parallel3d.planner.estimate import peak_for
from parallel3d.planner.hardware import gpu

H100 = gpu("h100")
QWEN_FOLDED = ["parallel.tp=2", "parallel.sp=true", "parallel.pp=8", "parallel.schedule=interleaved",
               "parallel.virtual_stages=4", "parallel.ep=32", "parallel.etp=1"]
QWEN_A2A = ["parallel.tp=2", "parallel.sp=true", "parallel.pp=32", "parallel.schedule=interleaved",
            "parallel.virtual_stages=3", "parallel.ep=8", "parallel.etp=1"]
ROWS = [  # (name, config, world, overrides, gpu key, device, published, unit, what differs)
    ("Qwen3-235B-A22B TP2 EP32 PP8 VPP4, DeepEP", "qwen3_235b_a22b", 256, QWEN_FOLDED, "h100", H100, 245,
     "TFLOP/s", "their DeepEP dispatcher; ours is a plain all-to-all at the same folded layout"),
    ("Qwen3-235B-A22B TP2 EP32 PP8 VPP4, DeepEP + 1F1B A2A overlap", "qwen3_235b_a22b", 256,
     [*QWEN_FOLDED, "parallel.ep_overlap=true"], "h100", H100, 276, "TFLOP/s",
     "both hide the all-to-all behind another microbatch's compute (ours: parallel.ep_overlap); DeepEP there"),
    ("Qwen3-235B-A22B TP2 EP8 PP32 VPP3, all-to-all dispatcher", "qwen3_235b_a22b", 256, QWEN_A2A, "h100", H100,
     200, "TFLOP/s", "comparable: the same plain all-to-all dispatcher, blocking"),
    ("DeepSeek-V3 671B PP16 EP64 ZeRO-1, 1F1B", "deepseek_v3", 2048, [], "h100", H100, 1543, "tokens/s",
     "DualPipe there, 1F1B here; FP8 GEMMs there, bf16 here; H800's NVLink is under half the H100's"),
    ("DeepSeek-V3 671B PP16 EP64 ZeRO-1, DualPipe-V", "deepseek_v3", 2048,
     ["parallel.schedule=dualpipe-v", "parallel.layers_per_stage=null", "parallel.ep_overlap=true"], "h100", H100,
     1543, "tokens/s", "DualPipe's pairs hide EP's all-to-all in both (ours: parallel.ep_overlap); FP8 there, "
     "bf16 here"),
]


MEASURED = 1.28
LOADS = (1.0, MEASURED, 1.5, 2.0)


def _distinct() -> list:
    """ROWS' layouts once each (the two DeepEP rows differ by ep_overlap), DualPipe-V (which does not fit
    balanced) last."""
    seen: dict = {}
    for name, config, world, ov, key, device, published, unit, differs in ROWS:
        seen.setdefault((config, world, tuple(ov)), (name, key, device, unit))
    return sorted(seen.items(), key=lambda kv: "dualpipe" in kv[1][0].lower())


def moe_load(rows: list, run_plan, command, GiB: float) -> None:
    """Plan every distinct MoE layout at each load in LOADS; the headroom is the peak over the balanced plan's."""
    print(f"\n## MoE dropless at routing loads {', '.join(f'{x:g}' for x in LOADS)} (measured here: {MEASURED}, "
          f"llama_100m EP 2)")
    for (config, world, ov), (name, key, device, unit) in _distinct():
        base = None
        for load in LOADS:
            r = run_plan(config, world, list(ov), device, expert_load=load)
            base = base or r
            tflops = r.mfu * peak_for(device, "bf16") / 1e12
            per_gpu = r.tokens_per_s / world
            extra = r.memory["peak"] - base.memory["peak"]
            print(f"{name} at load {load:g}: step {r.step_time_s:.1f} s ({r.step_time_s / base.step_time_s:.2f}x "
                  f"balanced), {tflops:.0f} TFLOP/s, {per_gpu:,.0f} tokens/s per GPU, peak "
                  f"{r.memory['peak'] / GiB:.1f} GiB (activations {r.memory['activations'] / GiB:.1f}, fits "
                  f"{r.fits}), headroom over balanced {extra / GiB:+.1f} GiB\n    "
                  f"{command(config, world, list(ov), key, load)}", flush=True)
            rows.append({"group": "moe-load", "name": name, "load": load, "step_s": r.step_time_s,
                         "tflops_per_gpu": tflops, "tokens_per_s_per_gpu": per_gpu, "mfu": r.mfu,
                         "peak_bytes": r.memory["peak"], "activation_bytes": r.memory["activations"],
                         "headroom_bytes": extra, "fits": r.fits, "gpu": device.name,
                         "command": command(config, world, list(ov), key, load)})


def moe(rows: list, run_plan, command, GiB: float) -> None:
    """Plan every row (planner_published.run_plan) and print it beside the published figure."""
    print("\n## MoE at published layouts (Megatron-Core Qwen3-235B-A22B on 256 H100; DeepSeek-V3 on 2,048 H800)")
    for name, config, world, ov, key, device, published, unit, differs in ROWS:
        r = run_plan(config, world, ov, device)
        tflops = r.mfu * peak_for(device, "bf16") / 1e12
        per_gpu = r.tokens_per_s / world
        ours = f"{tflops:.0f} TFLOP/s" if unit == "TFLOP/s" else f"{per_gpu:,.0f} tokens/s"
        print(f"{name}: published {published:,} {unit} per GPU | planner {ours} per GPU (MFU {r.mfu:.1%}, "
              f"{per_gpu:,.0f} tokens/s per GPU), step {r.step_time_s:.1f} s, bubble {r.bubble:.1%}, peak "
              f"{r.memory['peak'] / GiB:.1f} GiB (fits {r.fits}) on {device.name}\n    differs: {differs}\n    "
              f"{command(config, world, ov, key)}", flush=True)
        rows.append({"group": "moe", "name": name, "published": published, "unit": unit, "tflops_per_gpu": tflops,
                     "tokens_per_s_per_gpu": per_gpu, "mfu": r.mfu, "step_s": r.step_time_s, "bubble": r.bubble,
                     "peak_bytes": r.memory["peak"], "fits": r.fits, "gpu": device.name,
                     "command": command(config, world, ov, key)})
