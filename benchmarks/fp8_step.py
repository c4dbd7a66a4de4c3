"""The training step at Llama-3 8B's layer shapes on one GPU: bf16 against train.fp8=tensorwise and rowwise.

    python benchmarks/fp8_step.py [--layers N] [--steps 3] [--warmup 2] [--microbatches 2] [--json]
    python benchmarks/fp8_step.py --tiny          (CPU, a tiny model: the script's logic, for tests)

Shapes: hidden 4096, ffn 14336, GQA 32/8 heads (head dim 128), seq 8192, micro batch 1, vocabulary 32768 (the
head stays bf16 under fp8, so a small one keeps the step about the linears); as many layers as fit (--layers 0:
an estimate from free memory, 3/4 of it again after an out-of-memory). Every variant starts from the same
weights (drawn on the device, seeded: the CPU init of billions of parameters would take minutes) and sees the
same batches, so the loss difference is fp8's alone. Printed side by side: seconds per step, tokens/s, speed
against bf16, the last loss and its difference from bf16's, and the fp8 weight casts per step (one per weight and
scale axis with the weights cast once per step; tensor_parallel/fp8.py Fp8Casts). Timings are never asserted;
GPU results go to RESULTS.md.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA3_8B = ["model.hidden_size=4096", "model.num_heads=32", "model.num_kv_heads=8", "model.ffn_hidden_size=14336",
             "model.vocab_size=32768", "model.max_seq_len=8192", "train.seq_len=8192"]
TINY = ["model.hidden_size=64", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_hidden_size=192",
        "model.vocab_size=256", "model.max_seq_len=64", "train.seq_len=64"]
RECIPES = ("none", "tensorwise", "rowwise")


def config(shape: list[str], layers: int, recipe: str, microbatches: int):
    from parallel3d.models.config import ModelConfig
    from parallel3d.training.config import load_config
    from parallel3d.training.validate import resolve_and_validate

    return resolve_and_validate(load_config(os.path.join(ROOT, "configs/tiny.yaml"), [
        *shape, f"model.num_layers={layers}", "model.kernels=auto", "parallel.tp=1", "parallel.zero=0",
        "train.precision=bf16", f"train.fp8={recipe}", "train.micro_batch_size=1",
        f"train.global_batch_size={microbatches}", "train.activation_checkpointing=none", "train.warmup_steps=0",
        "train.lr=1e-4", "train.min_lr=1e-5", "log.interval=1000000"], ModelConfig), 1)


@torch.no_grad()
def device_init(model: torch.nn.Module, seed: int) -> None:
    """Seeded draws on the model's device (the same weights for every variant; not the layout-independent
    init of params.py, which draws on the CPU)."""
    gen = None
    for name, p in model.named_parameters():
        if gen is None:
            gen = torch.Generator(p.device).manual_seed(seed)
        init = getattr(getattr(p, "meta", None), "init", "normal")
        if init in ("ones", "zeros"):
            p.fill_(1.0 if init == "ones" else 0.0)
        else:
            p.normal_(0.0, 0.02, generator=gen)


def trainer(cfg, device: torch.device):
    from launch.common import stage_builder
    from parallel3d.mesh import ParallelContext
    from parallel3d.training.trainer import Trainer

    ctx = ParallelContext.single(device)
    build = stage_builder(cfg, ctx)

    def fast(layer_ids, pre, post):  # the benchmark's own init (device_init), instead of the CPU draws
        model = build(layer_ids, pre, post)
        model.init_weights = lambda seed: device_init(model, seed)
        return model
    return Trainer(cfg, ctx, fast)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(cfg, device: torch.device, steps: int, warmup: int) -> dict:
    """Seconds per step (median of `steps` after `warmup`), the losses and the weight casts per step."""
    from parallel3d.tensor_parallel.fp8 import casts_of

    tr = trainer(cfg, device)
    casts = casts_of(tr.chunks)
    losses, times, counts = [], [], []
    for i in range(warmup + steps):
        before = sum(c.weight_casts for c in casts)
        sync(device)
        t0 = time.perf_counter()
        losses.append(tr.train_step()["loss"])
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        counts.append(sum(c.weight_casts for c in casts) - before)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del tr
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return {"step_s": sorted(times)[len(times) // 2], "losses": losses, "weight_casts_per_step": counts[-1],
            "peak_gib": peak / 2 ** 30}


def auto_layers(device: torch.device) -> int:
    """Layers that should fit: free memory less the embeddings, over params * 18 B (bf16 weight, fp32 grad,
    master, Adam m and v) plus about 2.5 GiB of activations per layer at seq 8192."""
    if device.type != "cuda":
        return 2
    free = torch.cuda.mem_get_info(device)[0]
    per_layer = (4096 * (4096 + 2 * 1024 + 4096) + 3 * 4096 * 14336) * 18 + 2.5 * 2 ** 30
    embeddings = 2 * 32768 * 4096 * 18
    return max(1, min(40, int((0.85 * free - embeddings) // per_layer)))


def compare(shape, layers, device, steps, warmup, microbatches) -> list[dict]:
    rows = {}
    for recipe in reversed(RECIPES):  # the largest first: an out-of-memory shows before the others ran
        rows[recipe] = {"recipe": recipe, "layers": layers,
                        **run(config(shape, layers, recipe, microbatches), device, steps, warmup)}
    out = [rows[r] for r in RECIPES]
    base = out[0]
    tokens = microbatches * int(next(s for s in shape if s.startswith("train.seq_len")).split("=")[1])
    for r in out:
        r["tokens_per_s"] = tokens / r["step_s"]
        r["speedup"] = base["step_s"] / r["step_s"]
        r["loss_diff"] = r["losses"][-1] - base["losses"][-1]
    return out


def table(rows: list[dict]) -> str:
    lines = ["| recipe | layers | s/step | tokens/s | vs bf16 | last loss | - bf16 | weight casts/step | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {'bf16' if r['recipe'] == 'none' else r['recipe']} | {r['layers']} | {r['step_s']:.3f} | "
                     f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x | {r['losses'][-1]:.4f} | "
                     f"{r['loss_diff']:+.4f} | {r['weight_casts_per_step']} | {r['peak_gib']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (the script's logic only)")
    ap.add_argument("--layers", type=int, default=0, help="0: as many as should fit on the GPU")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="also print the rows as one JSON line")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    shape = TINY if args.tiny else LLAMA3_8B
    layers = args.layers or auto_layers(device)
    rows = None
    while rows is None:
        try:
            rows = compare(shape, layers, device, args.steps, args.warmup, args.microbatches)
        except torch.OutOfMemoryError:
            if layers == 1:
                raise
        if rows is None:  # outside the handler: its traceback (holding the failed trainer) is gone
            gc.collect()
            torch.cuda.empty_cache()
            layers = max(1, layers * 3 // 4)
            print(f"out of memory: retrying with {layers} layers", flush=True)
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{args.microbatches} microbatches of 1 x {shape[-1].split('=')[1]} tokens")
    print(table(rows))
    if args.json:
        print(json.dumps(rows))
    return rows


if __name__ == "__main__":
    main()
