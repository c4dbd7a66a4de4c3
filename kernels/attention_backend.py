"""Attention backends and the one function that chooses between them (model.attention).

    backend      what runs                                                  (out, lse) blocks for CP
    triton       our flash kernel (kernels.flash_attention)                 yes: forward and backward
    sdpa         torch SDPA; on the CPU aten's fused flash attention        aten's ops that return the lse and
                 (`_scaled_dot_product_flash_attention_for_cpu`)            have a backward taking (out, lse):
                                                                            CPU its flash op; CUDA its cuDNN op
                                                                            on Hopper, else FlashAttention-2's
                                                                            (`cuda_lse_op`), else the Triton kernel
    flash_attn   the flash-attn package (CUDA, fp16/bf16, head dim <= 256):   as sdpa (flash-attn has no public
                 `flash_attn_func` / `flash_attn_varlen_func`, (b, s, h, d)  backward-from-(out, lse) API)
    flex         torch's FlexAttention with a (document-)causal block mask   as auto
                 (kernels/flex_backend.py; trains on CUDA only)
    reference    exact einsum reference (fp64 for fp64 inputs): tests, and whatever no fused kernel covers

`select_attention(backend, q, need_lse, documents)` maps the model's setting to one of these. `backend` is the
model.attention value, or model.kernels ("auto" | "triton" | "torch") when model.attention is "auto":
  auto   fp64 -> reference (exact); CUDA without lse -> flash_attn when `why_not_flash_attn` finds no reason
         against it (installed, 16-bit, head dim <= 256), else sdpa; CUDA with lse (CP blocks) -> sdpa
         where one of SDPA's ops with the lse runs (16-bit, head dim <= 256, a multiple of 8), else triton;
         documents with the lse take triton on CUDA (SDPA's ops mask none); CPU -> sdpa; the meta stand-in ->
         what CUDA takes: `library` (kernels/attention_standin.py: the stand-in op of SDPA's / flash-attn's
         kernel, or with the lse of cuDNN's op), triton where CUDA runs FlashAttention-2's op or ours (they
         ran at the same rate); an explicit sdpa runs as on a CPU, and torch with lse as the reference
  torch  fp64 -> reference; CUDA blocks needing the lse -> reference; otherwise sdpa
An explicit flex runs FlexAttention wherever no lse is wanted (the meta stand-in: `library`), and as auto
for blocks with the lse and for fp64.
Causal blocks are bottom-right aligned (sk >= sq). The CPU flash op aligns a causal mask top-left and skips
only whole 512-key blocks: a causal call with sk > sq (the ring's and the all-gather mode's blocks too) runs
in bands of CAUSAL_BAND query rows, each a fully visible key prefix plus a causal square, the two partial
results merged through their lse. On CUDA the same split runs as one band, so that no op's own alignment
matters.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Optional

import torch

from parallel3d.kernels.attention_cuda import bhsd, cuda_flash, cuda_flash_backward, cuda_lse_op
from parallel3d.kernels.flex_backend import check_flex

ATTENTION_BACKENDS = ("auto", "triton", "sdpa", "flash_attn", "flex")
# Rows per band of a causal call on the CPU. aten's CPU flash op skips only whole 512-key blocks above the
# diagonal, so a causal square of n <= 512 costs as much as a full one; cut into bands of h rows (each a full
# prefix plus an h x h causal square) it computes about (1/2 + h/2n) of the scores (fwd+bwd, 8 heads, d=64,
# one thread: causal 512 from 24.4 to 15.1 ms, 1024 from 74.8 to 55.7 ms at h = 128; 256: 17.4, 59.7 ms).
CAUSAL_BAND = 128
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


def select_attention(backend: str, q: torch.Tensor, need_lse: bool, documents: bool = False) -> str:
    """-> "triton" | "sdpa" | "flash_attn" | "flex" | "reference" (| "library" on meta) for q (b, s, h, d); see the
    module docstring. `documents`: the call masks packed documents, which SDPA's CUDA ops with the lse cannot
    (the dry run drops the masks: they change no shape)."""
    if backend not in ATTENTION_BACKENDS + _KERNEL_SETTINGS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS + _KERNEL_SETTINGS}, got {backend!r}")
    exact = q.dtype == torch.float64
    if backend == "flex":
        if need_lse or exact:
            backend = "auto"
        elif q.is_meta:
            return "library"   # priced as the libraries' kernels (no measured FlexAttention rate yet)
        else:
            check_flex(q.device, torch.is_grad_enabled() and q.requires_grad)
            return "flex"
    if q.is_meta and not exact and backend not in ("reference", "sdpa"):
        # the dry run stands in for CUDA (below), where every backend is a flash kernel (out + lse saved, no
        # scores): ours is its custom op, whose fake implementation and FLOP formula (kernels/ops.py) the
        # planner reads; a library's (SDPA's / flash-attn's) is a stand-in op (kernels/attention_standin.py)
        # with the same shapes and FLOPs under its own name, priced at its own rate. An explicit sdpa runs
        # as on a CPU (aten's CPU flash op in bands): the planner's stand-in for a CPU run asks for it
        # (planner/host_kernels.py)
        if backend == "torch":
            return "reference" if need_lse else "library"   # torch with the lse: CUDA runs the reference
        # with the lse CUDA takes cuDNN's op where it runs and FlashAttention-2's or ours elsewhere, which ran at
        # the same rate (cuda_lse_op): those are priced as ours
        if backend == "triton" or (need_lse and cuda_lse_op(q) != "cudnn"):
            return "triton"
        return "library"
    if backend == "reference":
        return "reference"
    if backend == "triton":
        if not q.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError("attention backend 'triton' on a CPU tensor needs TRITON_INTERPRET=1 in the "
                               "environment before kernels are imported (docs/models.md, Kernels)")
        return "triton"
    if backend == "torch":
        return "reference" if exact or (on_gpu(q) and need_lse) else "sdpa"
    if backend == "flash_attn":
        why_not = why_not_flash_attn(q)
        if why_not:
            raise ValueError(f"model.attention=flash_attn cannot run here: {why_not}")
    if on_gpu(q) and need_lse:
        # blocks that merge through their lse (CP): SDPA's CUDA ops return it and their backward takes the
        # merged (out, lse); cuDNN's ran 1.2-1.6x ours forward, 1.5-1.9x backward on an H200 (cuda_lse_op)
        if exact:
            return "reference"
        return "sdpa" if cuda_lse_op(q) and not documents else "triton"
    if backend in ("flash_attn", "sdpa"):
        return backend
    # auto
    if exact:
        return "reference"
    if on_gpu(q):
        # SDPA's CUDA kernels (FlashAttention-2 / cuDNN) ran causal GQA at 3.6x (forward) and 4x (forward +
        # backward) our Triton kernel's speed on an H200 (benchmarks/RESULTS.md, kernels)
        return "flash_attn" if not why_not_flash_attn(q) else "sdpa"
    return "sdpa"


def _cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        bhsd(q), bhsd(k), bhsd(v), 0.0, causal, scale=scale)  # (b, hq, sq, d), (b, hq, sq); GQA native
    return bhsd(out), lse


def _cpu_flash_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        bhsd(do), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse.to(q.dtype if q.dtype == torch.float64
                                                                      else torch.float32), 0.0, causal, scale=scale)
    return bhsd(dq), bhsd(dk), bhsd(dv)


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    return (cuda_flash if q.is_cuda else _cpu_flash)(q, k, v, causal, scale)


def _flash_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    return (cuda_flash_backward if q.is_cuda else _cpu_flash_backward)(do, q, k, v, out, lse, causal, scale)


def _bands(sq: int, sk: int, band: int) -> list[tuple[int, int, int]]:
    """Causal (bottom-right) attention of sq queries on sk keys as bands of `band` rows [(q0, q1, kc)]: rows
    [q0, q1) see keys [0, kc) fully and keys [kc, kc + q1 - q0) through a causal square (top-left =
    bottom-right on a square, so the result does not hang on the op's own alignment)."""
    if sk < sq:
        raise ValueError(f"causal block with fewer keys ({sk}) than queries ({sq}): rows without keys are "
                         f"not supported by the sdpa backend")
    return [(q0, min(q0 + band, sq), sk - sq + q0) for q0 in range(0, sq, band)]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def sdpa_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (b, sq, hq, d) in q.dtype, lse (b, hq, sq) fp32) through aten's flash op (CPU or CUDA), causal
    bottom-right. A causal call runs band by band (module docstring; on CUDA one band of every row): each
    band's full prefix and causal square merge through their lse, lse = logaddexp(l1, l2),
    out = o1 + exp(l2 - lse) * (o2 - o1)."""
    if not causal:
        return _flash(q, k, v, False, scale)
    bands = _bands(q.shape[1], k.shape[1], q.shape[1] if q.is_cuda else CAUSAL_BAND)
    if bands == [(0, q.shape[1], 0)]:
        return _flash(q, k, v, True, scale)
    b, sq, hq, _ = q.shape
    out = torch.empty_like(q)  # (b, sq, hq, d)
    lse = torch.empty((b, hq, sq), dtype=_acc(q.dtype), device=q.device)
    for q0, q1, kc in bands:
        rows, diag = slice(q0, q1), slice(kc, kc + q1 - q0)
        o2, l2 = _flash(q[:, rows], k[:, diag], v[:, diag], True, scale)  # the band's causal square
        if kc == 0:
            out[:, rows], lse[..., rows] = o2, l2
            continue
        o1, l1 = _flash(q[:, rows], k[:, :kc], v[:, :kc], False, scale)  # keys every row of the band sees
        lse[..., rows] = torch.logaddexp(l1, l2)  # (b, hq, n): every row sees at least one key
        w2 = torch.exp(l2 - lse[..., rows]).transpose(1, 2)[..., None]  # (b, n, hq, 1)
        out[:, rows] = torch.lerp(o1.to(w2.dtype), o2.to(w2.dtype), w2)
    return out, lse


def sdpa_attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's (dq, dk, dv) given the final (merged) out and lse of its query rows (see
    parallel3d.context_parallel.blocks: with the global lse each block's P is its slice of the full softmax,
    so the per-piece gradients add up: per band, dq of the rows from both pieces, dk/dv summed per key)."""
    do, out = do.to(q.dtype), out.to(q.dtype)
    if not causal:
        return _flash_backward(do, q, k, v, out, lse, False, scale)
    bands = _bands(q.shape[1], k.shape[1], q.shape[1] if q.is_cuda else CAUSAL_BAND)
    if bands == [(0, q.shape[1], 0)]:
        return _flash_backward(do, q, k, v, out, lse, True, scale)
    acc = _acc(q.dtype)
    dq = torch.empty(q.shape, dtype=acc, device=q.device)  # (b, sq, hq, d)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)  # (b, sk, hk, d)
    dv = torch.zeros(v.shape, dtype=acc, device=q.device)
    for q0, q1, kc in bands:
        rows, diag = slice(q0, q1), slice(kc, kc + q1 - q0)
        part = (do[:, rows], q[:, rows])
        dq2, dk2, dv2 = _flash_backward(*part, k[:, diag], v[:, diag], out[:, rows], lse[..., rows], True, scale)
        dk[:, diag] += dk2
        dv[:, diag] += dv2
        if kc == 0:
            dq[:, rows] = dq2
            continue
        dq1, dk1, dv1 = _flash_backward(*part, k[:, :kc], v[:, :kc], out[:, rows], lse[..., rows], False, scale)
        dq[:, rows] = dq1.to(acc) + dq2
        dk[:, :kc] += dk1
        dv[:, :kc] += dv1
    return dq, dk, dv


class SdpaBlockFunction(torch.autograd.Function):
    """(out, lse) of aten's flash attention (CPU or CUDA), differentiable through out (lse is not)."""

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
