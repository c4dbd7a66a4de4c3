"""Attention backends and the one function that chooses between them (model.attention).

    backend      what runs                                                  (out, lse) blocks for CP
    triton       our flash kernel (kernels.flash_attention)                 yes: forward and backward
    sdpa         torch SDPA; on the CPU aten's fused flash attention        CPU: aten's flash op, which returns
                 (`_scaled_dot_product_flash_attention_for_cpu`)            the lse and has a backward taking
                                                                            (out, lse); CUDA: the Triton kernel
    flash_attn   the flash-attn package (CUDA, fp16/bf16, head dim <= 256):   the Triton kernel (flash-attn has no
                 `flash_attn_func` / `flash_attn_varlen_func`, (b, s, h, d)  public backward-from-(out, lse) API)
    reference    exact einsum reference (fp64 for fp64 inputs): tests, and whatever no fused kernel covers

`select_attention(backend, q, need_lse)` maps the model's setting to one of these. `backend` is the
model.attention value, or model.kernels ("auto" | "triton" | "torch") when model.attention is "auto":
  auto   fp64 -> reference (exact); CUDA -> flash_attn when `why_not_flash_attn` finds no reason against it
         (installed, 16-bit, head dim <= 256) and no lse is needed, else triton; CPU -> sdpa; the meta stand-in -> triton (its custom op)
  torch  fp64 -> reference; CUDA blocks needing the lse -> reference; otherwise sdpa
The CPU flash op aligns a causal mask top-left; for blocks with more keys than queries (the ring's and the
all-gather mode's bottom-right aligned blocks) the keys are split into a fully visible prefix and a causal
square, and the two partial results are merged through their lse.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

ATTENTION_BACKENDS = ("auto", "triton", "sdpa", "flash_attn")
_KERNEL_SETTINGS = ("auto", "triton", "torch", "reference")


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def on_gpu(q: torch.Tensor) -> bool:
    """The selector's one question about the device (tests stand a CPU tensor in for a GPU by patching it)."""
    return q.is_cuda


def why_not_flash_attn(q: torch.Tensor) -> str:
    """Why the flash-attn package cannot run attention on q (b, s, h, d); empty when it can."""
    if not flash_attn_available():
        return "the flash-attn package is not installed"
    if not on_gpu(q):
        return f"it runs on CUDA devices only (got {q.device.type})"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"it takes fp16/bf16 activations only (got {q.dtype})"
    if q.shape[-1] > 256:
        return f"it takes head dims up to 256 (got {q.shape[-1]})"
    return ""


def attention_setting(attention: str, kernels: str) -> str:
    """The one backend string a model hands to attention: model.attention, or model.kernels when auto."""
    return kernels if attention == "auto" else attention


def select_attention(backend: str, q: torch.Tensor, need_lse: bool) -> str:
    """-> "triton" | "sdpa" | "flash_attn" | "reference" for q (b, s, h, d); see the module docstring."""
    if backend not in ATTENTION_BACKENDS + _KERNEL_SETTINGS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS + _KERNEL_SETTINGS}, got {backend!r}")
    exact = q.dtype == torch.float64
    if q.is_meta and not exact and backend != "reference":
        # the dry run stands in for CUDA, where every backend is a flash kernel (out + lse saved, no scores):
        # our kernel's custom op, whose fake implementation and FLOP formula (kernels/ops.py) the planner reads
        return "triton"
    if backend == "reference":
        return "reference"
    if backend == "triton":
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError("attention backend 'triton' on a CPU tensor needs TRITON_INTERPRET=1 in the "
                               "environment before kernels are imported (DESIGN.md section 5)")
        return "triton"
    if backend == "flash_attn":
        why_not = why_not_flash_attn(q)
        if why_not:
            raise ValueError(f"model.attention=flash_attn cannot run here: {why_not}")
        return "triton" if need_lse else "flash_attn"
    if backend == "sdpa":
        return "triton" if on_gpu(q) and need_lse else "sdpa"
    if backend == "torch":
        return "reference" if exact or (on_gpu(q) and need_lse) else "sdpa"
    # auto
    if exact:
        return "reference"
    if on_gpu(q):
        return "flash_attn" if not why_not_flash_attn(q) and not need_lse else "triton"
    return "sdpa"


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (b, s, h, d) <-> (b, h, s, d)


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale)  # (b, hq, sq, d), (b, hq, sq); GQA native
    return _bhsd(out), lse


def _cpu_flash_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _bhsd(do), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse.to(q.dtype if q.dtype == torch.float64
                                                                      else torch.float32), 0.0, causal, scale=scale)
    return _bhsd(dq), _bhsd(dk), _bhsd(dv)


def _split(sq: int, sk: int, causal: bool) -> Optional[int]:
    """Keys visible to every query under the bottom-right causal mask (None: no split needed)."""
    if causal and sk > sq:
        return sk - sq
    if causal and sk < sq:
        raise ValueError(f"causal block with fewer keys ({sk}) than queries ({sq}): rows without keys are "
                         f"not supported by the sdpa backend")
    return None


def sdpa_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU: (out (b, sq, hq, d) in q.dtype, lse (b, hq, sq) fp32) through aten's flash op, causal bottom-right."""
    cut = _split(q.shape[1], k.shape[1], causal)
    if cut is None:
        return _cpu_flash(q, k, v, causal, scale)
    o1, l1 = _cpu_flash(q, k[:, :cut], v[:, :cut], False, scale)  # keys every query sees
    o2, l2 = _cpu_flash(q, k[:, cut:], v[:, cut:], True, scale)  # the causal square
    lse = torch.logaddexp(l1, l2)  # (b, hq, sq): every row sees at least key 0
    w1, w2 = (torch.exp(l - lse).transpose(1, 2)[..., None] for l in (l1, l2))  # (b, sq, hq, 1)
    return (w1 * o1 + w2 * o2).to(q.dtype), lse


def sdpa_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's (dq, dk, dv) given the final (merged) out and lse of its query rows (see
    parallel3d.context_parallel.blocks: with the global lse each block's P is its slice of the full softmax,
    so the per-piece gradients add up)."""
    do, out = do.to(q.dtype), out.to(q.dtype)
    cut = _split(q.shape[1], k.shape[1], causal)
    if cut is None:
        return _cpu_flash_backward(do, q, k, v, out, lse, causal, scale)
    dq1, dk1, dv1 = _cpu_flash_backward(do, q, k[:, :cut], v[:, :cut], out, lse, False, scale)
    dq2, dk2, dv2 = _cpu_flash_backward(do, q, k[:, cut:], v[:, cut:], out, lse, True, scale)
    return dq1 + dq2, torch.cat([dk1, dk2], 1), torch.cat([dv1, dv2], 1)


class SdpaBlockFunction(torch.autograd.Function):
    """(out, lse) of aten's CPU flash attention, differentiable through out (lse is not)."""

    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float):
        out, lse = sdpa_attention_with_lse(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (causal, scale)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = sdpa_attention_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def flash_attn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         scale: Optional[float]) -> torch.Tensor:
    """The flash-attn package's attention (b, s, h, d) layout, GQA and bottom-right causal natively."""
    from flash_attn import flash_attn_func
    return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)
