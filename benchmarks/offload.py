"""Offload benchmarks: CPU AdamW throughput, and step time / memory of every offload mode.

    python benchmarks/offload.py adamw  [--params 16000000] [--threads 1 2]
    python benchmarks/offload.py modes  [--steps 4]
    python benchmarks/offload.py overlap [--steps 5]

adamw: parameters per second of one AdamW step on fp32 host tensors, for
    ours       data_parallel/adamw.adamw_flat_ (blocked single-tensor arithmetic, the update every home runs)
    ours-unblocked / ours-b8k / ours-b32k   the same with other block sizes
    torch single / foreach / fused          torch.optim.AdamW(foreach=False / foreach=True / fused=True)
    torch.compile(single-tensor)            Inductor's fused loop of the same arithmetic
    DeepSpeedCPUAdam                        when `deepspeed` imports and its CPU op builds
and whether each result is bit-identical to torch's single-tensor AdamW (the on-device update).
modes: one process per mode (world 1, a ~34M-parameter model, fp32, ZeRO-1; ZeRO-3 for parameter
offload): median step time, resident memory in use after the steps (after malloc_trim) and the state
bytes the optimizer keeps in tensors.
overlap: the same step with the offload copies beside compute (the default: copy engine, ZeRO-3 fetches
one unit ahead, NVMe parameter reads on the I/O thread ahead of use) and without (every copy done where
it is issued, on the main thread; each unit's fetch issued with its gather and waited for at once).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from parallel3d.data_parallel.adamw import adamw_flat_  # noqa: E402

LR, BETAS, EPS, WD, STEP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 3


def _state(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g), torch.randn(n, generator=g) * 1e-2,
            torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5)


def _ours(block):
    def run(p, g, m, v):
        adamw_flat_(p, m, v, g, [(0, p.numel())], LR, BETAS, EPS, WD, STEP, **({} if block is None else
                                                                              {"block": block}))
    return run


def _torch(**flags):
    def run(p, g, m, v, pieces=64):
        # the same flat state seen as `pieces` tensors (a bucket's parameters)
        ps = [t.requires_grad_(False) for t in p.chunk(pieces)]
        params = [torch.nn.Parameter(t, requires_grad=True) for t in ps]
        for prm, gg in zip(params, g.chunk(pieces)):
            prm.grad = gg
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, **flags)
        for prm, mm, vv in zip(params, m.chunk(pieces), v.chunk(pieces)):
            opt.state[prm] = {"step": torch.tensor(float(STEP - 1)), "exp_avg": mm, "exp_avg_sq": vv}
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0  # the optimizer's own time, not the set-up above
    return run


def _compiled():
    """torch.compile of the same single-tensor arithmetic (Inductor's fused C++ loop); compiled on first use."""
    def update(p, m, v, g, lr_wd: float, bc2_sqrt: float, step_size: float):
        p.mul_(1 - lr_wd)
        m.lerp_(g, 1 - BETAS[0])
        v.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
        p.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(EPS), value=-step_size)
    compiled = torch.compile(update, fullgraph=True, dynamic=False)
    args = (LR * WD, math.sqrt(1 - BETAS[1] ** STEP), LR / (1 - BETAS[0] ** STEP))
    warmed: set[int] = set()

    def run(p, g, m, v):
        if p.numel() not in warmed:  # compile outside the timed call, at the timed size
            compiled(p.clone(), m.clone(), v.clone(), g, *args)
            warmed.add(p.numel())
        t0 = time.perf_counter()
        compiled(p, m, v, g, *args)
        return time.perf_counter() - t0
    return run


def _deepspeed():
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except Exception as e:  # not installed, or its C++ op does not build here
        return None, f"{type(e).__name__}: {str(e)[:80]}"

    def run(p, g, m, v):
        prm = torch.nn.Parameter(p, requires_grad=True)
        prm.grad = g
        opt = DeepSpeedCPUAdam([prm], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw_mode=True)
        opt.state[prm] = {"step": STEP - 1, "exp_avg": m, "exp_avg_sq": v}
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0
    return run, ""


def bench_adamw(n: int, threads: list[int], repeat: int = 5, deepspeed: bool = False) -> list[dict]:
    impls = {"ours (block 128k)": _ours(None), "ours-b32k": _ours(1 << 15), "ours-b8k": _ours(1 << 13),
             "ours-unblocked": _ours(n), "torch single-tensor": _torch(foreach=False),
             "torch foreach": _torch(foreach=True), "torch fused": _torch(fused=True),
             "torch.compile(single-tensor)": _compiled()}
    ds, why = _deepspeed() if deepspeed else (None, "not requested (--deepspeed)")
    if ds is not None:
        impls["DeepSpeedCPUAdam"] = ds
    ref = _state(n)
    _torch(foreach=False)(*ref)          # the on-device update's arithmetic: torch single-tensor AdamW
    rows = []
    for nt in threads:
        torch.set_num_threads(nt)
        for name, fn in impls.items():
            times = []
            for _ in range(repeat):
                p, g, m, v = _state(n)
                t0 = time.perf_counter()
                inner = fn(p, g, m, v)
                times.append(inner if isinstance(inner, float) else time.perf_counter() - t0)
            exact = all(torch.equal(a, b) for a, b in zip((p, m, v), (ref[0], ref[2], ref[3])))
            t = statistics.median(times)
            rows.append({"impl": name, "threads": nt, "ms": t * 1e3, "params_per_s": n / t, "exact": exact})
    if ds is None:
        rows.append({"impl": "DeepSpeedCPUAdam", "skipped": why})
    return rows


MODES = {
    "none (zero=1)": ["parallel.zero=1"],
    "optimizer cpu": ["parallel.zero=1", "parallel.offload_optimizer=cpu"],
    "optimizer nvme": ["parallel.zero=1", "parallel.offload_optimizer=nvme", "parallel.offload_dir={d}"],
    "none (zero=3)": ["parallel.zero=3"],
    "zero3 params cpu + optimizer cpu": ["parallel.zero=3", "parallel.offload_params=cpu",
                                         "parallel.offload_optimizer=cpu"],
    "zero3 params nvme + optimizer nvme": ["parallel.zero=3", "parallel.offload_params=nvme",
                                           "parallel.offload_optimizer=nvme", "parallel.offload_dir={d}"],
}
WIDE = ["model.hidden_size=1024", "model.ffn_hidden_size=4096", "model.num_heads=8", "model.num_kv_heads=8",
        "model.num_layers=2", "model.vocab_size=256", "train.seq_len=16", "train.global_batch_size=1",
        "train.precision=fp32", "parallel.offload_buffer_mb=64"]

ONE_MODE = r"""
import ctypes, json, os, sys, time
import torch
sys.path.insert(0, "tests")
from ckpt_helpers import build_trainer, context_for, make_config
torch.set_num_threads(1)
cfg = make_config(json.loads(sys.argv[1]), 1)
trainer = build_trainer(cfg, context_for(cfg))
if len(sys.argv) > 3 and sys.argv[3] == "serial":   # benchmarks only: the offload copies without overlap
    trainer.optimizer.homes.copies.synchronous = True
    if trainer.optimizer.zero3 is not None:
        trainer.optimizer.zero3.read_ahead = False
times = []
for _ in range(int(sys.argv[2])):
    t0 = time.perf_counter(); trainer.train_step(); times.append(time.perf_counter() - t0)
ctypes.CDLL("libc.so.6").malloc_trim(0)
with open("/proc/self/statm") as f:
    rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
mem = trainer.optimizer.memory_bytes()
print(json.dumps({"times": times, "rss": rss, "optimizer_tensors": mem["optimizer"], "params_tensors": mem["params"]}))
"""


def _one(overrides: list[str], steps: int, how: str = "") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    with tempfile.TemporaryDirectory() as d:
        args = [*WIDE, *(o.format(d=d) for o in overrides)]
        out = subprocess.run([sys.executable, "-c", ONE_MODE, json.dumps(args), str(steps), how], cwd=ROOT, env=env,
                             capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


OVERLAP = {  # what the overlap hides: the gradient/parameter copies, the NVMe parameter reads
    "optimizer cpu, ZeRO-1": ["parallel.zero=1", "parallel.offload_optimizer=cpu"],
    "optimizer cpu, ZeRO-0 bf16": ["parallel.zero=0", "parallel.offload_optimizer=cpu", "train.precision=bf16"],
    "ZeRO-3 params nvme + optimizer cpu, 4 layers": ["parallel.zero=3", "parallel.offload_params=nvme",
                                                     "parallel.offload_optimizer=cpu", "parallel.offload_dir={d}",
                                                     "model.num_layers=4"],
}


def bench_overlap(steps: int, repeat: int = 3) -> list[dict]:
    """Median step time without and with overlap, the two runs interleaved `repeat` times (load drifts)."""
    rows = []
    for name, overrides in OVERLAP.items():
        times = {"serial": [], "overlap": []}
        for _ in range(repeat):
            for how in times:
                times[how] += _one(overrides, steps, how)["times"][1:]
        serial, overlap = statistics.median(times["serial"]), statistics.median(times["overlap"])
        rows.append({"mode": name, "serial_s": serial, "overlap_s": overlap, "speedup": serial / overlap})
    return rows


def bench_modes(steps: int) -> list[dict]:
    rows = []
    for name, overrides in MODES.items():
        r = _one(overrides, steps)
        rows.append({"mode": name, "step_s": statistics.median(r["times"][1:]), "rss_mb": r["rss"] / 2 ** 20,
                     "optimizer_tensor_mb": r["optimizer_tensors"] / 2 ** 20, "param_tensor_mb": r["params_tensors"] / 2 ** 20})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["adamw", "modes", "overlap"])
    ap.add_argument("--params", type=int, default=16_000_000)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--deepspeed", action="store_true", help="also DeepSpeedCPUAdam (builds a C++ op on first use)")
    a = ap.parse_args()
    if a.what == "adamw":
        rows = bench_adamw(a.params, a.threads, deepspeed=a.deepspeed)
        print("| impl | threads | ms | M params/s | bit-identical to torch single-tensor |\n|---|---:|---:|---:|---|")
        for r in rows:
            if "skipped" in r:
                print(f"| {r['impl']} | - | - | - | skipped: {r['skipped']} |")
            else:
                print(f"| {r['impl']} | {r['threads']} | {r['ms']:.1f} | {r['params_per_s'] / 1e6:.1f} | "
                      f"{'yes' if r['exact'] else 'no'} |")
    elif a.what == "overlap":
        rows = bench_overlap(a.steps)
        print("| mode | step s, copies serial | step s, overlapped (default) | speedup |\n|---|---:|---:|---:|")
        for r in rows:
            print(f"| {r['mode']} | {r['serial_s']:.3f} | {r['overlap_s']:.3f} | {r['speedup']:.2f}x |")
    else:
        rows = bench_modes(a.steps)
        print("| mode | step s | RSS in use MB | optimizer state in tensors MB | parameter tensors MB |\n"
              "|---|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['mode']} | {r['step_s']:.2f} | {r['rss_mb']:.0f} | {r['optimizer_tensor_mb']:.0f} | "
                  f"{r['param_tensor_mb']:.0f} |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
