"""Throughput, MFU and per-step metric logging (docs/training.md, Metrics).

FLOPs per token = 6 * N + 12 * L * h * s: 6N for the forward and backward matmuls over the N parameters
a token actually meets (for MoE only the routed top-k experts plus shared experts and router: the
*active* parameters), 12*L*h*s for the attention score and value matmuls at sequence length s.
N excludes the input embedding table (a lookup, no FLOPs) but counts the output projection (a matmul),
as in PaLM / TorchTitan. MFU = achieved FLOP/s per device / that device's peak.
Multi-Latent Attention (attention_type "mla") counts its own projections (down to the latents, latent norms,
up to per-head q/k/v, output) and its real attention width: 6 * L * s * n_heads * (d_qk + d_v) instead of
12 * L * h * s (d_qk = qk_nope + qk_rope head dims; the two agree when n_heads * d = h).

Model fields are read by name (`parallel3d` does not import `models`).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Callable, Optional, TextIO

import torch

from parallel3d.hardware import PEAK_FLOPS, peak_flops_of
from parallel3d.training.config import TransformerShape


def _mlp_params(hidden: int, ffn: int) -> int:
    return 3 * hidden * ffn                  # SwiGLU: gate, up, down


def _mla_attention_params(m: TransformerShape) -> int:
    """One MLA layer: W_qa + q norm + W_qb (or W_q), W_kva + kv norm + W_kvb, W_o (models/mla.py)."""
    h, n, rq, rkv = m.hidden_size, m.num_heads, m.q_lora_rank, m.kv_lora_rank
    d_rope, d_nope, d_v = m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
    d_qk = d_nope + d_rope
    q = h * rq + rq + rq * n * d_qk if rq else h * n * d_qk
    kv = h * (rkv + d_rope) + rkv + rkv * n * (d_nope + d_v)
    return q + kv + n * d_v * h


def _is_mla(m: TransformerShape) -> bool:
    return m.attention_type == "mla"


def param_counts(m: TransformerShape) -> dict[str, int]:
    """Parameter counts by part from model fields: embedding, output, attention, dense_mlp,
    experts_total, experts_active (routed top_k per token), shared_experts, router, norms, mtp.
    Multi-token prediction modules (mtp_depth D) count as D more MoE layers plus their projections and norms."""
    h, L, V = m.hidden_size, m.num_layers, m.vocab_size
    mtp = m.mtp_depth
    head_dim = m.head_dim or h // m.num_heads  # Qwen3 decouples it from h / heads
    kv = m.num_kv_heads
    experts = m.num_experts
    moe_layers = max(0, L - m.first_k_dense) + mtp if experts else 0
    dense_layers = L + mtp - moe_layers
    fe = m.moe_ffn_hidden_size or m.ffn_hidden_size
    expert = _mlp_params(h, fe)
    return {
        "embedding": V * h,
        "output": 0 if m.tie_embeddings else V * h,
        "attention": (L + mtp) * (_mla_attention_params(m) if _is_mla(m) else
                          2 * h * m.num_heads * head_dim + 2 * h * kv * head_dim),
        "dense_mlp": dense_layers * _mlp_params(h, m.ffn_hidden_size),
        "experts_total": moe_layers * experts * expert,
        "experts_active": moe_layers * min(m.moe_top_k, experts) * expert,
        "shared_experts": moe_layers * m.num_shared_experts * expert,
        "router": moe_layers * experts * h,
        "norms": (2 * L + 1) * h + (2 * L * head_dim if m.qk_norm else 0),
        "mtp": mtp * (2 * h * h + 5 * h),  # projection [emb; hidden] -> h, its block's 2 norms and 3 of its own
    }


def total_params(m: TransformerShape) -> int:
    """All parameters of the model described by `m`."""
    c = param_counts(m)
    return sum(v for k, v in c.items() if k != "experts_active")


def active_params(m: TransformerShape) -> int:
    """Parameters one token uses: everything except the routed experts it is not sent to."""
    c = param_counts(m)
    return sum(v for k, v in c.items() if k != "experts_total")


def flops_per_token(m: TransformerShape, seq_len: int) -> float:
    """Training FLOPs per token: 6 * N_matmul + 12 * L * h * s, with N_matmul = active parameters
    minus the input-embedding lookup plus the output projection (once, even when tied). The attention
    width is heads * head_dim, h unless head_dim is set apart from h / heads (Qwen3-30B-A3B: 4096, h 2048)."""
    c = param_counts(m)
    mtp = m.mtp_depth
    n = active_params(m) - c["embedding"] - c["output"] + (1 + mtp) * m.vocab_size * m.hidden_size  # head per depth
    if _is_mla(m):  # scores over d_qk, values of width d_v, per head
        width = m.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
        return 6.0 * n + 6.0 * (m.num_layers + mtp) * width * seq_len
    attn_width = (m.head_dim or m.hidden_size // m.num_heads) * m.num_heads  # h unless head_dim is set
    return 6.0 * n + 12.0 * m.num_layers * attn_width * seq_len


def peak_flops_table() -> dict[str, dict[str, float]]:
    """Dense per-device peak FLOP/s by precision (parallel3d/hardware.py: the planner's table too)."""
    return dict(PEAK_FLOPS)


def lookup_peak_flops(device_name: str, precision: str) -> Optional[float]:
    """Table peak for a `torch.cuda.get_device_name()` string, or None for an unknown device."""
    return peak_flops_of(device_name, precision)


def measure_cpu_matmul_flops(n: int = 512, repeats: int = 3) -> float:
    """Best-of-`repeats` fp32 matmul FLOP/s on this CPU with the current torch thread count: the
    honest 'peak' for CPU runs, which have no spec sheet. Takes a few tens of milliseconds."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)                           # warm up the BLAS
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / max(best, 1e-9)


def resolve_peak_flops(precision: str, device: Optional[torch.device] = None,
                       override: Optional[float] = None) -> float:
    """Per-device peak FLOP/s: `override` if given, else the table for the CUDA device, else a
    measured CPU matmul rate. Call once and keep the result (measuring costs time)."""
    if override:
        return float(override)
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        kind = precision
        if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32:
            kind = "tf32"
        peak = lookup_peak_flops(torch.cuda.get_device_name(device), kind)
        if peak is not None:
            return peak
    return measure_cpu_matmul_flops()


def peak_memory_bytes(device: Optional[torch.device] = None) -> int:
    """Peak allocated CUDA memory on a CUDA device, else this process's max resident set size."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
        import sys
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)   # Linux reports KiB
    except (ImportError, AttributeError):
        return 0


def _scalar(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    return x


class RunTotals:
    """What this run did, accumulated from the step records, for the summary line at its end."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: Optional[dict] = None
        self.last: Optional[dict] = None
        self.steps = self.skipped = self.tokens = 0
        self.step_time = 0.0
        self.eval_loss: Optional[float] = None

    def add(self, record: dict) -> None:
        self.first = self.first or record
        self.last = record
        self.steps += 1
        self.skipped += int(bool(record.get("skipped", False)))
        self.tokens += record["tokens"]
        self.step_time += record["step_time_s"]
        if record.get("eval_loss") is not None:
            self.eval_loss = record["eval_loss"]

    def summary(self, started: Optional[float] = None) -> str:
        wall = time.perf_counter() - (self.start if started is None else started)
        if self.first is None:
            return f"done: no steps run (the run was already complete) | wall {wall:.1f} s"
        first, last = self.first, self.last
        parts = [f"done: {self.steps} steps (step {first['step']} to {last['step']})",
                 f"loss {first['loss']:.4f} -> {last['loss']:.4f}"]
        if self.eval_loss is not None:
            parts.append(f"eval loss {self.eval_loss:.4f}")
        if self.skipped:
            parts.append(f"skipped {self.skipped}")
        tok_s = self.tokens / self.step_time if self.step_time > 0 else 0.0
        parts += [f"{self.tokens:,} tokens at {tok_s:,.0f} tok/s", f"wall {wall:.1f} s"]
        return " | ".join(parts)


class MetricsLogger:
    """One JSON object per optimizer step to a jsonl file, a progress line, optional TensorBoard.

    Only rank 0 (`is_rank0`) writes the file, prints and writes TensorBoard; every rank gets the record
    back from `log`. `tokens` passed to `log` is the number of tokens in the global batch, and MFU is
    achieved FLOP/s per device (over `world_size` devices) divided by `peak_flops` per device. The peak is
    resolved once here (table, override or CPU measurement) and cached on this object.
    """

    def __init__(self, jsonl_path: Optional[str], *, flops_per_token: float, world_size: int = 1,
                 peak_flops: Optional[float] = None, precision: str = "fp32",
                 device: Optional[torch.device] = None, tensorboard_dir: Optional[str] = None,
                 is_rank0: bool = True, print_interval: int = 1,
                 printer: Callable[[str], None] = print) -> None:
        self.flops_per_token, self.world_size = flops_per_token, world_size
        self.device, self.is_rank0 = device, is_rank0
        self.print_interval, self.printer = max(1, print_interval), printer
        self.peak_flops = resolve_peak_flops(precision, device, peak_flops)
        self._file: Optional[TextIO] = None
        self._tb = None
        self._run = RunTotals()
        if is_rank0 and jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            self._file = open(jsonl_path, "a")
        if is_rank0 and tensorboard_dir:  # config validation checked that the package is installed
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(tensorboard_dir)

    def log(self, step: int, *, loss: float, grad_norm: float, lr: float, tokens: int,
            elapsed_s: float, extra: Optional[dict] = None) -> dict:
        """Record one optimizer step; returns the record (also on ranks that do not write)."""
        tokens_per_s = tokens / elapsed_s if elapsed_s > 0 else 0.0
        mfu = tokens_per_s * self.flops_per_token / (self.peak_flops * self.world_size)
        record = {"step": int(step), "loss": float(_scalar(loss)), "grad_norm": float(_scalar(grad_norm)),
                  "lr": float(lr), "tokens": int(tokens), "step_time_s": float(elapsed_s),
                  "tokens_per_s": tokens_per_s, "mfu": mfu,
                  "peak_mem_bytes": peak_memory_bytes(self.device)}
        for k, v in (extra or {}).items():
            record[k] = _scalar(v)
        self._run.add(record)
        if not self.is_rank0:
            return record
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(f"train/{k}", v, step)
        evaluated = record.get("eval_loss") is not None
        if step % self.print_interval == 0 or evaluated:  # an eval loss is always shown when computed
            line = (f"step {step:>6} | loss {record['loss']:.4f} | gnorm {record['grad_norm']:.3f} | "
                    f"lr {lr:.2e} | {tokens_per_s:,.0f} tok/s | mfu {100 * mfu:.2f}% | "
                    f"mem {record['peak_mem_bytes'] / 2 ** 30:.2f} GiB")
            if evaluated:
                line += f" | eval loss {record['eval_loss']:.4f}"
            if self._run.skipped:
                line += f" | skipped {self._run.skipped}"
            self.printer(line)
        return record

    def summary(self, started: Optional[float] = None) -> str:
        """One line for the end of a run: steps, loss from and to, throughput, wall time since `started`
        (a `time.perf_counter()` value; default: this logger's creation)."""
        return self._run.summary(started)

    def print_summary(self, started: Optional[float] = None) -> None:
        if self.is_rank0:
            self.printer(self.summary(started))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
