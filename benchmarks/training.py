"""Tokens/s and MFU of a full training step (parallel3d Trainer) vs Hugging Face transformers.

    python benchmarks/training.py [--preset tiny|100m|1b] [--steps 5] [--compile]

World size 1 on the local device (CPU here, CUDA when present). The HF side is LlamaForCausalLM with the
same shape and batch, AdamW, optionally torch.compile'd. MFU = tokens/s * FLOPs/token / peak, with
FLOPs/token = 6 N + 12 L h s (DESIGN.md 4); the CPU peak is a measured fp32 matmul rate.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PRESETS = {  # name: model fields and batch
    "tiny": dict(model=dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                            ffn_hidden_size=172), batch=8, seq=128),
    "100m": dict(model=dict(vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                            ffn_hidden_size=2048), batch=2, seq=256),
    "1b": dict(model=dict(vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8,
                          ffn_hidden_size=5632), batch=8, seq=2048),
}


def _time(step, steps: int, device: torch.device) -> float:
    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def ours(preset: dict, steps: int, device: torch.device, precision: str) -> float:
    from models.config import ModelConfig
    from models.llama import Llama
    from parallel3d.mesh import ParallelContext
    from parallel3d.data_parallel import DistributedOptimizer

    ctx = ParallelContext.single(device)
    model = Llama(ModelConfig(**preset["model"]), ctx).to(device)
    model.init_weights(0)
    opt = DistributedOptimizer([model], ctx, precision=precision, lr=1e-4)
    tokens = torch.randint(0, preset["model"]["vocab_size"], (preset["batch"], preset["seq"] + 1), device=device)
    pos = torch.arange(preset["seq"], device=device)

    def step():
        opt.zero_grad()
        opt.set_last_microbatch(True)
        loss = model(tokens[:, :-1], pos, tokens[:, 1:]) / tokens[:, 1:].numel()
        opt.scale_loss(loss).backward()
        opt.finish_grad_sync()
        opt.clip_grad_norm(1.0)
        opt.step(1e-4)
    return _time(step, steps, device)


def huggingface(preset: dict, steps: int, device: torch.device, precision: str, compile_: bool) -> float:
    import transformers

    m = preset["model"]
    cfg = transformers.LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["hidden_size"],
                                   num_hidden_layers=m["num_layers"], num_attention_heads=m["num_heads"],
                                   num_key_value_heads=m["num_kv_heads"], intermediate_size=m["ffn_hidden_size"])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    fwd = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, m["vocab_size"], (preset["batch"], preset["seq"]), device=device)

    def step():
        opt.zero_grad()
        fwd(tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return _time(step, steps, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), nargs="+", default=["tiny", "100m"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile(HF model)")
    ap.add_argument("--precision", default=None, help="fp32 (CPU default) or bf16 (CUDA default)")
    args = ap.parse_args()
    from models.config import ModelConfig
    from parallel3d.training.metrics import flops_per_token, resolve_peak_flops

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    peak = resolve_peak_flops(precision, device, None)
    print(f"device {device}, precision {precision}, peak {peak / 1e12:.2f} TFLOP/s")
    print(f"{'preset':<6} {'impl':<18} {'step s':>8} {'tok/s':>10} {'MFU':>7} {'vs ours':>8}")
    for name in args.preset:
        preset = PRESETS[name]
        tokens = preset["batch"] * preset["seq"]
        fpt = flops_per_token(ModelConfig(**preset["model"]), preset["seq"])
        rows = [("parallel3d", ours(preset, args.steps, device, precision))]
        rows.append(("transformers", huggingface(preset, args.steps, device, precision, False)))
        if args.compile:
            rows.append(("transformers+compile", huggingface(preset, args.steps, device, precision, True)))
        for impl, t in rows:
            print(f"{name:<6} {impl:<18} {t:8.3f} {tokens / t:10.0f} {tokens / t * fpt / peak:7.2%} "
                  f"{t / rows[0][1]:8.2f}")


if __name__ == "__main__":
    main()
