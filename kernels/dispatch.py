"""Pick an implementation per op: Triton on CUDA, the torch reference elsewhere.

backend: "auto" (Triton when the tensor is on CUDA and Triton imports), "triton" (forced; on CPU this
needs TRITON_INTERPRET=1 set before import) or "torch".
"""
from __future__ import annotations

from typing import Optional

import torch

from kernels.cross_entropy import cross_entropy_reference
from kernels.flash_attention import attention_reference, sdpa_attention
from kernels.rmsnorm import rmsnorm_reference
from kernels.rope import rope_reference
from kernels.swiglu import swiglu_reference

BACKENDS = ("auto", "triton", "torch")


def use_triton(backend: str, x: torch.Tensor) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"model.kernels must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "triton":
        return True
    return x.is_cuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    if use_triton(backend, x):
        from kernels.rmsnorm import rmsnorm
        return rmsnorm(x, weight, eps)
    return rmsnorm_reference(x, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "auto"
         ) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(backend, q):
        from kernels.rope import rope as rope_triton
        return rope_triton(q, k, cos, sin)
    return rope_reference(q, k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    if use_triton(backend, gate):
        from kernels.swiglu import swiglu as swiglu_triton
        return swiglu_triton(gate, up)
    return swiglu_reference(gate, up)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  backend: str = "auto") -> torch.Tensor:
    """Per-token losses (n,) fp32."""
    if use_triton(backend, logits):
        from kernels.cross_entropy import cross_entropy as ce_triton
        return ce_triton(logits, target, ignore_index)
    return cross_entropy_reference(logits, target, ignore_index)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: Optional[float] = None, backend: str = "auto") -> torch.Tensor:
    """(b, s, hq, d) attention without lse (SDPA on the torch path)."""
    if use_triton(backend, q):
        from kernels.flash_attention import flash_attention
        return flash_attention(q, k, v, causal, scale)[0]
    return sdpa_attention(q, k, v, causal, scale)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                       scale: Optional[float] = None, backend: str = "auto"
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (b, sq, hq, d), lse (b, hq, sq) fp32): the block function ring attention merges."""
    if use_triton(backend, q):
        from kernels.flash_attention import flash_attention
        return flash_attention(q, k, v, causal, scale)
    return attention_reference(q, k, v, causal, scale)
