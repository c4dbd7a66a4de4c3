"""The planner against published runs, regenerated from one command whenever the cost model changes.

    python benchmarks/planner_published.py [--only megatron,llama3,llama3-fit,torchtitan,offload,moe,moe-load] [--json]

Every row prints the exact `launch/plan.py` overrides it plans (so any row can be rerun alone), the
published figure and ours. Groups:
  megatron    Narayanan et al., SC'21, Table 1 (DGX A100): GPT 7.5B / 39.1B / 145.6B, stood in for by our
              Llama block of the same size (MHA, SwiGLU FFN of 8h/3 rounded to 128, vocab 51200, tied
              embeddings, seq 2048, full recomputation, no SP, no distributed optimizer). Their Table 1
              prints hardware FLOP/s with the recomputation pass (4 passes, not 3): model-FLOPs MFU = 3/4 of it.
  llama3      Dubey et al. 2024, Table 4: 405B on 8,192 and 16,384 H100 at TP8 PP16 (DP 64 / 128), seq 8192,
              16M tokens per step, the paper's interleaved schedule (v=2 here).
  llama3-fit  within the paper's TP8 PP16 layouts, the fastest configuration that fits in 80 GB, searched
              over the schedule (1F1B, interleaved v=2), activation checkpointing (selective, full) and
              train.recompute_layers (when the key exists), with its predicted MFU beside 43% / 41%.
  torchtitan  TorchTitan's H100 table (docs/performance.md, Dec 2024): Llama 3.1 8B on 128 GPUs FSDP (local
              batch 2, selective AC, no compile, bf16), 70B on 256 GPUs FSDP32 x TP8 (local batch 16, full
              AC, Float8), 405B on 512 GPUs FSDP8 x TP8 x PP8 interleaved 1F1B (local batch 32, full AC,
              Float8), tokens/s per GPU. Their H100s are HBM2e 96 GB SXM parts at a 500 W limit (2.4 TB/s;
              the bf16 peak "between SXM and NVL", i.e. 835-989 TFLOP/s): each row is planned on our H100
              (989, 3.35 TB/s) and on that part at the NVL bound (835, 2.4 TB/s, 96 GB), the range the
              500 W parts fall in. torch.compile is not modeled (our dry run runs eager).
  offload     the largest Llama-shaped model on one 80 GB H100 per offload mode (seq 4096, micro-batch 1,
              full recomputation), beside DeepSpeed ZeRO-Offload's 13B on one 32 GB V100.
  moe         Megatron-Core's three Qwen3-235B-A22B rows on 256 H100 and DeepSeek-V3 at its report's layout
              (planner_published_moe.py says what each row's run would do differently).
  moe-load    the same MoE rows planned dropless at routing loads 1 (balanced), 1.28 (measured here), 1.5 and 2
              (`--moe-load`): step, throughput, peak and the headroom over the balanced plan a dropless run needs.
Plans whose dry runs are the same (offload modes: the stand-in runs without offload) share them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "launch"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import stage_builder  # noqa: E402
from offload_capacity import shape  # noqa: E402
from planner_published_moe import moe as moe_rows, moe_load as moe_load_rows  # noqa: E402
from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.planner.dryrun import DryRunError  # noqa: E402
from parallel3d.planner.estimate import plan  # noqa: E402
from parallel3d.planner.hardware import GPU, gpu  # noqa: E402
from parallel3d.training.config import ConfigError, TrainConfig, load_config  # noqa: E402
from parallel3d.training.validate import resolve_and_validate  # noqa: E402

GiB = 2 ** 30
CACHE: dict = {}
A100, H100 = gpu("a100"), gpu("h100")
# TorchTitan's H100: HBM2e 96 GB at 2.4 TB/s, 500 W; bf16 peak at H100 NVL's 835 TFLOP/s (their lower bound)
TITAN_H100 = dataclasses.replace(H100, name="H100 HBM2e 96GB 500W (NVL-bound peak)",
                                 peak_flops={**H100.peak_flops, "bf16": 835e12, "fp8": 1670e12},
                                 hbm_bytes_per_s=2.4e12, memory_bytes=96e9)
HAS_RECOMPUTE_LAYERS = "recompute_layers" in TrainConfig.__dataclass_fields__


def _ffn(h: int) -> int:
    return round(8 * h / 3 / 128) * 128


def gpt(h: int, layers: int, heads: int, tp: int, pp: int, batch: int) -> list[str]:
    return [f"model.hidden_size={h}", f"model.num_layers={layers}", f"model.num_heads={heads}",
            f"model.num_kv_heads={heads}", f"model.ffn_hidden_size={_ffn(h)}", "model.vocab_size=51200",
            "model.tie_embeddings=true", "model.max_seq_len=2048", "model.rope_scaling=null",
            "train.seq_len=2048", "train.micro_batch_size=1", f"train.global_batch_size={batch}",
            "train.activation_checkpointing=full", "train.precision=bf16", f"parallel.tp={tp}", f"parallel.pp={pp}",
            "parallel.sp=false", "parallel.zero=0", "parallel.schedule=1f1b", "parallel.virtual_stages=1",
            "parallel.dp=0"]


MEGATRON = [  # (name, world, overrides, published HW TFLOP/s, published HW utilisation)
    ("GPT 7.5B, 128 A100", 128, gpt(4096, 36, 32, 4, 1, 512), 142, 0.46),
    ("GPT 39.1B, 512 A100", 512, gpt(8192, 48, 64, 8, 2, 1536), 138, 0.44),
    ("GPT 145.6B, 1536 A100", 1536, gpt(12288, 80, 96, 8, 8, 2304), 148, 0.47),
]
L3 = ["parallel.tp=8", "parallel.pp=16", "parallel.sp=true", "parallel.zero=1", "train.seq_len=8192",
      "train.micro_batch_size=1", "train.global_batch_size=2048", "parallel.dp=0"]
LLAMA3 = [  # (name, world, overrides, published MFU)
    ("Llama 3 405B, 8192 H100", 8192, L3 + ["parallel.schedule=interleaved", "parallel.virtual_stages=2"], 0.43),
    ("Llama 3 405B, 16384 H100", 16384, L3 + ["parallel.schedule=interleaved", "parallel.virtual_stages=2"], 0.41),
]
TITAN = [  # (name, config, world, overrides, published tokens/s per GPU)
    ("Llama 3.1 8B, 128 H100 FSDP", "llama3_8b", 128,
     ["parallel.tp=1", "parallel.pp=1", "parallel.sp=false", "parallel.zero=3", "parallel.dp=0",
      "train.seq_len=8192", "train.micro_batch_size=2", "train.global_batch_size=256",
      "train.activation_checkpointing=selective"], 5605),
    ("Llama 3.1 70B, 256 H100 FSDP32 x TP8", "llama3_70b", 256,
     ["parallel.tp=8", "parallel.pp=1", "parallel.sp=true", "parallel.zero=3", "parallel.dp=0",
      "parallel.schedule=1f1b", "parallel.virtual_stages=1", "train.seq_len=8192", "train.micro_batch_size=16", "train.global_batch_size=512",
      "train.activation_checkpointing=full", "train.fp8=tensorwise"], 829),
    ("Llama 3.1 405B, 512 H100 FSDP8 x TP8 x PP8 interleaved", "llama3_405b", 512,
     ["parallel.tp=8", "parallel.pp=8", "parallel.sp=true", "parallel.zero=3", "parallel.dp=0",
      "parallel.schedule=interleaved", "parallel.virtual_stages=2", "train.seq_len=8192",
      "train.micro_batch_size=1", "train.global_batch_size=256", "train.activation_checkpointing=full",
      "train.fp8=tensorwise"], 128),
]
SIZES = [  # Llama-shaped models for one GPU: (name, config, overrides)
    ("Llama-3.2-3B shape (3.2B)", "llama3_8b", ["model.hidden_size=3072", "model.num_layers=28",
                                                 "model.num_heads=24", "model.ffn_hidden_size=8192",
                                                 "model.tie_embeddings=true"]),
    ("Llama-3-8B", "llama3_8b", []),
    ("12.3B (h 5120, 40 layers)", "llama3_8b", ["model.hidden_size=5120", "model.num_layers=40",
                                              "model.num_heads=40", "model.ffn_hidden_size=13824"]),
    ("30.7B (h 6656, 64 layers)", "llama3_8b", shape("30b")),  # the rung offload_capacity.py confirmed
    ("35.3B (h 8192, 48 layers)", "llama3_70b", ["model.num_layers=48", "model.ffn_hidden_size=22016"]),
    ("Llama-3-70B", "llama3_70b", []),
]
ONE_GPU = ["parallel.tp=1", "parallel.pp=1", "parallel.sp=false", "parallel.dp=0", "parallel.schedule=1f1b",
           "parallel.virtual_stages=1", "train.seq_len=4096",
           "train.micro_batch_size=1", "train.global_batch_size=1", "train.activation_checkpointing=full"]
OFFLOAD_MODES = [
    ("none", ["parallel.zero=0"]),
    ("optimizer cpu", ["parallel.zero=0", "parallel.offload_optimizer=cpu"]),
    ("ZeRO-3, parameters + optimizer cpu", ["parallel.zero=3", "parallel.offload_optimizer=cpu",
                                            "parallel.offload_params=cpu"]),
]


def run_plan(config: str, world: int, overrides: list[str], device: GPU, gpus_per_node: int = 8,
             expert_load: float = 1.0):
    cfg = load_config(str(ROOT / "configs" / f"{config}.yaml"), overrides, ModelConfig)
    cfg = resolve_and_validate(cfg, world)
    return plan(cfg, stage_builder, device, gpus_per_node, cache=CACHE, expert_load=expert_load)


def command(config: str, world: int, overrides: list[str], device: str, expert_load: float = 1.0) -> str:
    load = f"--moe-load {expert_load:g} " if expert_load != 1.0 else ""
    return f"python launch/plan.py --config configs/{config}.yaml --world-size {world} --gpu {device} {load}" + \
        " ".join(overrides)


def megatron(rows: list) -> None:
    print("\n## Megatron-LM SC'21 Table 1 (A100)")
    for name, world, ov, tflops, hw in MEGATRON:
        r = run_plan("llama3_8b", world, ov, A100)
        published = hw * 3 / 4
        print(f"{name}: published {tflops} TF/s = {hw:.0%} HW, {published:.1%} MFU | planner MFU {r.mfu:.1%}, "
              f"step {r.step_time_s:.2f} s, bubble {r.bubble:.1%}, peak {r.memory['peak'] / GiB:.1f} GiB "
              f"(fits {r.fits})\n    {command('llama3_8b', world, ov, 'a100')}", flush=True)
        rows.append({"group": "megatron", "name": name, "published_mfu": published, "mfu": r.mfu,
                     "step_s": r.step_time_s, "bubble": r.bubble, "peak_bytes": r.memory["peak"], "fits": r.fits,
                     "command": command("llama3_8b", world, ov, "a100")})


def llama3(rows: list) -> None:
    print("\n## Llama 3 Table 4 (H100), the paper's layout")
    for name, world, ov, mfu in LLAMA3:
        r = run_plan("llama3_405b", world, ov, H100)
        print(f"{name}: published {mfu:.0%} MFU | planner MFU {r.mfu:.1%}, step {r.step_time_s:.2f} s, bubble "
              f"{r.bubble:.1%}, peak {r.memory['peak'] / GiB:.1f} GiB (fits {r.fits})\n    "
              f"{command('llama3_405b', world, ov, 'h100')}", flush=True)
        rows.append({"group": "llama3", "name": name, "published_mfu": mfu, "mfu": r.mfu, "step_s": r.step_time_s,
                     "bubble": r.bubble, "peak_bytes": r.memory["peak"], "fits": r.fits,
                     "command": command("llama3_405b", world, ov, "h100")})


def llama3_fit(rows: list) -> None:
    """Every candidate at 8,192 and at 16,384 GPUs (the latter first tries 8,192's two fastest fitting ones)."""
    print("\n## Llama 3 405B within TP8 PP16: the fastest configuration that fits in 80 GB")
    if not HAS_RECOMPUTE_LAYERS:
        print("(train.recompute_layers does not exist in this checkout: that dimension is skipped)")
    candidates = []
    # The paper's interleaved schedule; 1F1B keeps more activations in flight on stage 0 for no less bubble
    # (at 8,192 GPUs: 131 GiB selective, 29.1% MFU with full recomputation), so it is not searched here.
    for schedule, v in (("interleaved", 2),):
        for ac, n in (("selective", 0), ("selective", 1), ("selective", 2), ("selective", 4), ("full", 0)):
            if n and not HAS_RECOMPUTE_LAYERS:
                continue
            ov = L3 + [f"parallel.schedule={schedule}", f"parallel.virtual_stages={v}",
                       f"train.activation_checkpointing={ac}"]
            candidates.append(ov + ([f"train.recompute_layers={n}"] if HAS_RECOMPUTE_LAYERS else []))
    fitting_at_8192: list = []
    for name, world, _, mfu in LLAMA3:
        order = candidates
        if fitting_at_8192:
            order = fitting_at_8192[:2] + [c for c in candidates if c not in fitting_at_8192[:2]]
        best = None
        for ov in order:   # every candidate at both sizes: at 16,384 fewer microbatches are in flight, so
            # a cheaper configuration than 8,192's best may fit there
            short = " ".join(o.split(".", 1)[1] for o in ov[len(L3):])
            try:
                r = run_plan("llama3_405b", world, ov, H100)
            except (ConfigError, ValueError, DryRunError) as e:
                print(f"  {world}: {short}: refused: {e}")
                continue
            print(f"  {world}: {short}: MFU {r.mfu:.1%} peak {r.memory['peak'] / GiB:.1f} GiB fits {r.fits}",
                  flush=True)
            if r.fits:
                if world == 8192:
                    fitting_at_8192.append((r.mfu, ov))
                if best is None or r.mfu > best[0].mfu:
                    best = (r, ov)
        if world == 8192:
            fitting_at_8192 = [ov for _, ov in sorted(fitting_at_8192, key=lambda x: -x[0])]
        if best is None:
            print(f"{name}: no configuration within TP8 PP16 fits in 80 GB")
            rows.append({"group": "llama3-fit", "name": name, "published_mfu": mfu, "mfu": None, "fits": False})
            continue
        r, ov = best
        print(f"{name}: best fitting: MFU {r.mfu:.1%} (published {mfu:.0%}), peak {r.memory['peak'] / GiB:.1f} GiB"
              f"\n    {command('llama3_405b', world, ov, 'h100')}", flush=True)
        rows.append({"group": "llama3-fit", "name": name, "published_mfu": mfu, "mfu": r.mfu, "fits": True,
                     "peak_bytes": r.memory["peak"], "step_s": r.step_time_s,
                     "command": command("llama3_405b", world, ov, "h100")})


def torchtitan(rows: list) -> None:
    print("\n## TorchTitan H100 table (tokens/s per GPU)")
    for name, config, world, ov, tps in TITAN:
        out = {"group": "torchtitan", "name": name, "published_tokens_per_s_per_gpu": tps,
               "command": command(config, world, ov, "h100")}
        for label, device in (("h100", H100), ("titan_h100", TITAN_H100)):
            try:
                r = run_plan(config, world, ov, device)
            except (ConfigError, ValueError, DryRunError) as e:
                print(f"{name}: refused: {e}\n    {out['command']}")
                out["refused"] = str(e)
                break
            out[f"{label}_tokens_per_s_per_gpu"] = r.tokens_per_s / world
            out[f"{label}_peak_bytes"], out[f"{label}_fits"] = r.memory["peak"], r.fits
        if "refused" not in out:
            print(f"{name}: published {tps:,} | planner {out['h100_tokens_per_s_per_gpu']:,.0f} (H100 SXM 989 TF, "
                  f"3.35 TB/s), {out['titan_h100_tokens_per_s_per_gpu']:,.0f} (835 TF, 2.4 TB/s); peak "
                  f"{out['h100_peak_bytes'] / GiB:.1f} GiB\n    {out['command']}", flush=True)
        rows.append(out)


def offload(rows: list) -> None:
    print("\n## Largest model on one 80 GB H100 per offload mode (seq 4096, micro-batch 1, full recomputation)")
    for mode, extra in OFFLOAD_MODES:
        largest = None
        for name, config, ov in SIZES:
            overrides = ONE_GPU + ov + extra
            r = run_plan(config, 1, overrides, H100)
            print(f"  {mode}: {name}: peak {r.memory['peak'] / GiB:.1f} GiB (grads {r.memory['grads'] / GiB:.1f}), "
                  f"fits {r.fits}, step {r.step_time_s:.1f} s", flush=True)
            if not r.fits:
                break
            largest = (name, r, command(config, 1, overrides, "h100"))
        if largest is None:
            print(f"{mode}: not even the smallest fits")
            rows.append({"group": "offload", "mode": mode, "largest": None})
            continue
        name, r, cmd = largest
        print(f"{mode}: largest that fits: {name} (peak {r.memory['peak'] / GiB:.1f} GiB, step {r.step_time_s:.1f} s)"
              f"  [DeepSpeed ZeRO-Offload: 13B on one 32 GB V100]\n    {cmd}", flush=True)
        rows.append({"group": "offload", "mode": mode, "largest": name, "peak_bytes": r.memory["peak"],
                     "step_s": r.step_time_s, "command": cmd})


def moe(rows: list) -> None:
    moe_rows(rows, run_plan, command, GiB)


def moe_load(rows: list) -> None:
    moe_load_rows(rows, run_plan, command, GiB)


GROUPS = {"megatron": megatron, "llama3": llama3, "llama3-fit": llama3_fit, "torchtitan": torchtitan,
          "offload": offload, "moe": moe, "moe-load": moe_load}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=None, help=f"comma-separated groups: {', '.join(GROUPS)}")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    groups = args.only.split(",") if args.only else list(GROUPS)
    for g in groups:
        if g not in GROUPS:
            ap.error(f"--only: unknown group {g!r}; known: {', '.join(GROUPS)}")
    print(f"host optimizer step (offload): {H100.host_step_params_per_s / 1e9:.2f} G params/s per rank "
          f"(planner/hardware.py: the offloaded step at one thread per torchrun rank)")
    rows: list = []
    t0 = time.perf_counter()
    for g in groups:
        GROUPS[g](rows)
    print(f"\n{len(rows)} rows in {time.perf_counter() - t0:.0f} s")
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
