"""Tokens/s and MFU of a full training step, eager vs torch.compile, parallel3d vs Hugging Face transformers.

    python benchmarks/training.py [--preset tiny 100m] [--steps 3] [--warmup 2] [--threads 1] [--precision fp32]

World size 1 on the local device (CPU here, CUDA when present). Four rows per preset, same shapes and batch,
each one forward + backward + grad-norm clip + AdamW step:
  parallel3d            the real Trainer (launch's stage builder, DistributedOptimizer), train.compile=false
  parallel3d+compile    the same with train.compile=true (each transformer block torch.compile'd)
  transformers          LlamaForCausalLM (SDPA attention), torch.optim.AdamW
  transformers+compile  torch.compile(LlamaForCausalLM)
The presets are the config files (tiny: configs/tiny.yaml; 100m: configs/llama_100m.yaml, ~110M parameters
with tied embeddings; 1b: that file with 1B shapes). Steady-state seconds per step are the mean of --steps
steps after --warmup; "first s" is the first step alone, i.e. what compilation adds is about first - step
(a cold compile: inductor's on-disk caches are off unless --warm-cache).
MFU = tokens/s * FLOPs/token / peak, FLOPs/token = 6 N + 12 L h s (docs/planner.md); the CPU peak is a measured
fp32 matmul rate.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

PRESETS = {  # name: config file, model overrides, batch (sequences), seq
    "tiny": ("configs/tiny.yaml", [], 8, 128),
    "100m": ("configs/llama_100m.yaml", [], 2, 256),
    "1b": ("configs/llama_100m.yaml", ["model.hidden_size=2048", "model.num_layers=16", "model.num_heads=16",
                                       "model.num_kv_heads=8", "model.ffn_hidden_size=5632"], 8, 2048),
}


IMPLS = ("parallel3d", "parallel3d+compile", "transformers", "transformers+compile")


def _time(step, steps: int, warmup: int, device: torch.device) -> tuple[float, float]:
    """(first step s, mean s of `steps` steps after `warmup` steps, the first included in the warm-up)."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    for _ in range(warmup - 1):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return first, (time.perf_counter() - t0) / steps


def config(name: str, precision: str, compile_blocks: bool):
    from parallel3d.models.config import ModelConfig
    from parallel3d.training.config import load_config
    from parallel3d.training.validate import resolve_and_validate

    path, over, batch, seq = PRESETS[name]
    return resolve_and_validate(load_config(os.path.join(ROOT, path), [
        *over, "parallel.tp=1", "parallel.zero=0", f"train.precision={precision}", f"train.seq_len={seq}",
        f"model.max_seq_len={max(seq, 128)}", f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}",
        f"train.compile={str(compile_blocks).lower()}", "train.activation_checkpointing=none",
        "train.warmup_steps=0", "log.interval=1000000"], ModelConfig), 1)


def ours(name: str, steps: int, warmup: int, device: torch.device, precision: str, compile_blocks: bool):
    from launch.common import stage_builder
    from parallel3d.mesh import ParallelContext
    from parallel3d.training.trainer import Trainer

    cfg = config(name, precision, compile_blocks)
    ctx = ParallelContext.single(device)
    trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx))
    return _time(trainer.train_step, steps, warmup, device)


def huggingface(name: str, steps: int, warmup: int, device: torch.device, precision: str, compile_: bool):
    import transformers

    cfg = config(name, precision, False)
    m = cfg.model
    hf = transformers.LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                                  num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                                  intermediate_size=m.ffn_hidden_size, rms_norm_eps=m.norm_eps,
                                  rope_theta=m.rope_theta, max_position_embeddings=m.max_seq_len,
                                  tie_word_embeddings=m.tie_embeddings, attn_implementation="sdpa")
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    with device:  # initialised where it runs: a 1B model's init on one CPU thread took over a minute
        model = transformers.LlamaForCausalLM(hf).to(dtype=dtype)
    fwd = torch.compile(model) if compile_ else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    _, _, batch, seq = PRESETS[name]
    tokens = torch.randint(0, m.vocab_size, (batch, seq), device=device)

    def step():
        opt.zero_grad()
        fwd(tokens, labels=tokens).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return _time(step, steps, warmup, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), nargs="+", default=["tiny", "100m"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="steps before timing (>= 1; the first compiles)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--precision", default=None, help="fp32 (CPU default) or bf16 (CUDA default)")
    ap.add_argument("--no-compile", action="store_true", help="eager rows only")
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=list(IMPLS), help="rows to run")
    ap.add_argument("--warm-cache", action="store_true",
                    help="let inductor reuse its on-disk caches (default: off, so 'first s' is a cold compile)")
    args = ap.parse_args()
    if not args.warm_cache:
        import torch._inductor.config as inductor_config
        inductor_config.force_disable_caches = True
    from parallel3d.training.metrics import flops_per_token, resolve_peak_flops

    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    peak = resolve_peak_flops(precision, device, None)
    print(f"device {device}, precision {precision}, threads {args.threads}, peak {peak / 1e12:.3f} TFLOP/s, "
          f"torch {torch.__version__}, steps {args.steps} after {args.warmup} warm-up")
    print(f"{'preset':<6} {'params':>7} {'impl':<21} {'first s':>8} {'step s':>8} {'tok/s':>9} {'MFU':>7} "
          f"{'vs eager':>8}")
    for name in args.preset:
        cfg = config(name, precision, False)
        _, _, batch, seq = PRESETS[name]
        tokens = batch * seq
        fpt = flops_per_token(cfg.model, seq)
        m = cfg.model
        n = m.vocab_size * m.hidden_size * (1 if m.tie_embeddings else 2) + m.num_layers * (
            2 * m.hidden_size ** 2 + 2 * m.hidden_size * m.num_kv_heads * (m.hidden_size // m.num_heads)
            + 3 * m.hidden_size * m.ffn_hidden_size)
        rows = []
        for impl, fn, flag in (("parallel3d", ours, False), ("parallel3d+compile", ours, True),
                               ("transformers", huggingface, False), ("transformers+compile", huggingface, True)):
            if (flag and args.no_compile) or impl not in args.impl:
                continue
            first, t = fn(name, args.steps, args.warmup, device, precision, flag)
            rows.append((impl, first, t))
            base = impl.split("+")[0]
            eager = next((r[2] for r in rows if r[0] == base), float("nan"))
            print(f"{name:<6} {n / 1e6:6.1f}M {impl:<21} {first:8.2f} {t:8.3f} {tokens / t:9.0f} "
                  f"{tokens / t * fpt / peak:7.2%} {eager / t:8.2f}", flush=True)
        t = {impl: step for impl, _, step in rows}
        ratio = [f"{label} {t['transformers' + k] / t['parallel3d' + k]:.2f}"
                 for k, label in (("", "eager"), ("+compile", "compiled"))
                 if "parallel3d" + k in t and "transformers" + k in t]
        if ratio:
            print(f"{name:<6} parallel3d tok/s / transformers tok/s: " + ", ".join(ratio), flush=True)


if __name__ == "__main__":
    main()
