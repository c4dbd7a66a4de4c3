"""Pick an implementation per op: Triton on CUDA, the torch reference elsewhere.

The Triton paths go through the `torch.library` custom ops of kernels.ops (fake implementations: they pass
through FakeTensorMode, the meta device and torch.compile without graph breaks).

backend: "auto" (Triton when the tensor is on CUDA and Triton imports), "triton" (forced; on CPU this
needs TRITON_INTERPRET=1 set before import) or "torch".

Entries: rms_norm, rms_norm_residual (fused add + norm), rope, swiglu, cross_entropy (per-token, full
vocab), cross_entropy_partial_stats / cross_entropy_partial_grad / vocab_parallel_cross_entropy (the
vocab-parallel pieces), fused_linear_cross_entropy (chunked, never the full logits), attention,
attention_with_lse (both with optional per-token document ids: packed-document / varlen attention;
backends: kernels.attention_backend), fp8_cast (train.fp8's fused amax + scale + saturating cast) and
fp8_scale_cast (its cast pass alone, with a given amax).
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from parallel3d.kernels.attention_backend import (ATTENTION_BACKENDS, SdpaBlockFunction, flash_attn_attention,  # noqa: F401
                                      sdpa_attention_backward, select_attention)
from parallel3d.kernels.cross_entropy import (cross_entropy_partial_grad_reference, cross_entropy_partial_stats_reference,
                                   cross_entropy_reference)
from parallel3d.kernels.flash_attention import attention_reference, sdpa_attention
from parallel3d.kernels.fp8_cast import cast_reference as fp8_cast_reference
from parallel3d.kernels.fused_linear_cross_entropy import fused_linear_cross_entropy as _fused_linear_ce
from parallel3d.kernels.rmsnorm import rmsnorm_reference, rmsnorm_residual_reference
from parallel3d.kernels.rope import rope_reference
from parallel3d.kernels.swiglu import swiglu_reference

BACKENDS = ("auto", "triton", "torch")


def use_triton(backend: str, x: torch.Tensor) -> bool:
    if backend not in BACKENDS:
        raise ValueError(f"model.kernels must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return False
    if backend == "triton":
        if not x.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError("backend 'triton' on a CPU tensor needs TRITON_INTERPRET=1 in the environment "
                               "before kernels are imported (docs/models.md, Kernels)")
        return True
    return x.is_cuda


def use_kernel_op(backend: str, x: torch.Tensor) -> bool:
    """use_triton, and also on `meta`, the dry run's stand-in for CUDA: there the custom op's fake
    implementation (kernels/ops.py) gives the kernel's outputs and saved tensors, so the planner counts the
    fused kernel's memory and traffic, not its torch twin's intermediates."""
    return (x.is_meta and backend != "torch") or use_triton(backend, x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, backend: str = "auto") -> torch.Tensor:
    if use_kernel_op(backend, x):
        from parallel3d.kernels import ops
        return ops.rmsnorm(x, weight, eps)
    return rmsnorm_reference(x, weight, eps)


def rms_norm_residual(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                      backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, new_residual): new_residual = x + residual, normed = rms_norm(new_residual)."""
    if use_kernel_op(backend, x):
        from parallel3d.kernels import ops
        return ops.rmsnorm_residual(x, residual, weight, eps)
    return rmsnorm_residual_reference(x, residual, weight, eps)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backend: str = "auto"
         ) -> tuple[torch.Tensor, torch.Tensor]:
    if use_kernel_op(backend, q):
        from parallel3d.kernels import ops
        return ops.rope(q, k, cos, sin)
    return rope_reference(q, k, cos, sin)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    if use_kernel_op(backend, gate):
        from parallel3d.kernels import ops
        return ops.swiglu(gate, up)
    return swiglu_reference(gate, up)


def fp8_cast(t: torch.Tensor, dtype: torch.dtype, axis: Optional[int] = None,
             reduce_amax: Optional[Callable[[torch.Tensor], torch.Tensor]] = None, backend: str = "auto",
             col_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(t8, fp32 inverse scale) of a 2-D t: one scale (axis None, shape ()), one per row (axis 1, (n, 1)) or
    per column (axis 0, (1, k)); `reduce_amax` (a TP MAX all-reduce) runs between the amax and the cast.
    col_major: t8 stored transposed (strides (1, n)), the layout a GEMM takes its second operand in."""
    if use_kernel_op(backend, t):
        from parallel3d.kernels import fp8_cast_ops
        return fp8_cast_ops.cast(t, dtype, axis, reduce_amax, col_major)
    return fp8_cast_reference(t, dtype, axis, reduce_amax, col_major)


def fp8_scale_cast(t: torch.Tensor, amax: torch.Tensor, dtype: torch.dtype, axis: Optional[int] = None,
                   backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The cast pass alone, with a given fp32 amax (shape (), (n, 1) or (1, k) for axis None, 1, 0)."""
    if use_kernel_op(backend, t):
        from parallel3d.kernels import fp8_cast_ops
        return fp8_cast_ops.cast_given_amax(t, amax, dtype, axis)
    from parallel3d.kernels.fp8_cast import scale_cast_reference
    return scale_cast_reference(t, amax, dtype)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,
                  backend: str = "auto") -> torch.Tensor:
    """Per-token losses (n,) fp32."""
    if use_triton(backend, logits):
        from parallel3d.kernels.cross_entropy import cross_entropy as ce_triton
        return ce_triton(logits, target, ignore_index)
    return cross_entropy_reference(logits, target, ignore_index)


def cross_entropy_partial_stats(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                ignore_index: int = -100, backend: str = "auto"
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vocab-parallel CE pieces of a logits shard: (local_max, local_sumexp, local_target_logit), each (n,).
    How to combine them across TP ranks: see the kernels.cross_entropy module docstring."""
    if use_triton(backend, logits):
        from parallel3d.kernels.cross_entropy import cross_entropy_partial_stats as stats
        return stats(logits, target, vocab_start, ignore_index)
    return cross_entropy_partial_stats_reference(logits, target, vocab_start, ignore_index)


def cross_entropy_partial_grad(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                               lse: torch.Tensor, grad_loss: torch.Tensor, ignore_index: int = -100,
                               backend: str = "auto") -> torch.Tensor:
    """d loss / d logits of a shard (n, v_local) given the global lse (n,) and dloss (n,)."""
    if use_triton(backend, logits):
        from parallel3d.kernels.cross_entropy import cross_entropy_partial_grad as grad
        return grad(logits, target, vocab_start, lse, grad_loss, ignore_index)
    return cross_entropy_partial_grad_reference(logits, target, vocab_start, lse, grad_loss, ignore_index)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, vocab_start: int,
                                 ignore_index: int, all_reduce_max: Callable[[torch.Tensor], torch.Tensor],
                                 all_reduce_sum: Callable[[torch.Tensor], torch.Tensor],
                                 backend: str = "auto") -> torch.Tensor:
    """Per-token loss (n,) from a logits shard; the caller supplies the TP-group all-reduces (MAX, SUM).
    Only the Triton path lives here; the torch path is parallel3d's own vocab-parallel loss."""
    if not use_triton(backend, logits):
        raise ValueError("vocab_parallel_cross_entropy is the Triton path; use the torch reference pieces "
                         "(cross_entropy_partial_stats/grad with backend='torch') elsewhere")
    from parallel3d.kernels.cross_entropy import vocab_parallel_cross_entropy as vp_ce
    return vp_ce(logits, target, vocab_start, ignore_index, all_reduce_max, all_reduce_sum)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               ignore_index: int = -100, chunk: Optional[int] = None, backend: str = "auto",
                               vocab_start: int = 0,
                               all_reduce_max: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                               all_reduce_sum: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                               reduction: str = "none") -> torch.Tensor:
    """Per-token loss (n,) of CE(hidden @ weight.T) computed `chunk` rows at a time (never the full logits;
    None: kernels.fused_linear_cross_entropy.head_chunk_rows), or with reduction="sum" their sum, whose
    gradients are formed in the forward (no logits recomputed). The chunking is used on both paths;
    `backend` picks the per-chunk CE (Triton kernels or torch).
    Vocab-parallel weight shard: pass vocab_start and the TP-group all-reduces (see the kernel module)."""
    return _fused_linear_ce(hidden, weight, target, ignore_index, chunk, use_triton(backend, hidden),
                            vocab_start, all_reduce_max, all_reduce_sum, reduction)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: Optional[float] = None, backend: str = "auto", doc_ids: Optional[torch.Tensor] = None,
              doc_ids_host: Optional[torch.Tensor] = None, doc_derived: Optional[dict] = None) -> torch.Tensor:
    """(b, s, hq, d) attention without lse. backend: a model.attention value or a model.kernels one
    (kernels.attention_backend.select_attention chooses).

    doc_ids (b, s): packed documents, causal only (kernels.varlen_attention): Triton kernel with document
    ids; flash-attn's varlen entry on CUDA (16-bit) when installed and backend is auto / flash_attn; else
    block-wise SDPA. doc_ids_host: a host copy (block plan / cu_seqlens without reading the device). On
    `meta` (the dry run) document masking changes no shape: the plain kernel's memory and work are an upper
    bound. doc_derived: the microbatch's dict where FlexAttention keeps its document mask (Documents.derived)."""
    if q.is_meta:
        doc_ids = None  # masking changes no shape on the stand-in: the plain kernel, an upper bound
    impl = select_attention(backend, q, need_lse=False)
    if doc_ids is not None and not causal:
        raise ValueError("document-masked attention is causal")
    if impl == "flex":
        from parallel3d.kernels.flex_backend import flex_attention
        return flex_attention(q, k, v, causal, scale, doc_ids, doc_derived)
    if doc_ids is not None:
        from parallel3d.kernels import varlen_attention as varlen
        host = doc_ids.cpu() if doc_ids_host is None else doc_ids_host
        if impl == "flash_attn":  # model.attention=flash_attn, or auto on CUDA with the package (select_attention)
            return varlen.flash_attn_varlen(q, k, v, host, scale)
        if impl == "triton":
            from parallel3d.kernels.flash_attention import flash_attention
            return flash_attention(q, k, v, causal, scale, q_doc=doc_ids, k_doc=doc_ids)[0]
        return varlen.varlen_sdpa(q, k, v, doc_ids, varlen.query_blocks(host), scale)
    if impl == "triton":
        from parallel3d.kernels import ops
        return ops.flash_attention(q, k, v, causal, scale)[0]
    if impl == "library":   # the meta stand-in for SDPA's / flash-attn's kernel on CUDA (select_attention)
        from parallel3d.kernels.attention_standin import library_attention
        return library_attention(q, k, v, causal, scale)[0]
    if impl == "flash_attn":
        return flash_attn_attention(q, k, v, causal, scale)
    if impl == "sdpa" and not q.is_cuda:  # aten's CPU flash op: GQA native (SDPA's enable_gqa is its slow math path)
        return SdpaBlockFunction.apply(q, k, v, causal, q.shape[-1] ** -0.5 if scale is None else scale)[0]
    if impl == "sdpa":
        return sdpa_attention(q, k, v, causal, scale)
    return attention_reference(q, k, v, causal, scale)[0]


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                       scale: Optional[float] = None, backend: str = "auto", doc_ids: Optional[torch.Tensor] = None,
                       k_doc_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (b, sq, hq, d), lse (b, hq, sq) fp32): the block function ring attention merges. Causal is
    bottom-right aligned (sk >= sq). Differentiable through out on every backend.
    doc_ids (b, sq) / k_doc_ids (b, sk, default doc_ids): a query sees only keys of its own document
    (the Triton kernel, else the exact reference)."""
    if q.is_meta:
        doc_ids = None  # as in `attention`
    impl = select_attention(backend, q, need_lse=True, documents=doc_ids is not None)
    if doc_ids is not None:
        if impl == "triton":
            from parallel3d.kernels.flash_attention import flash_attention
            return flash_attention(q, k, v, causal, scale, q_doc=doc_ids, k_doc=k_doc_ids)
        return attention_reference(q, k, v, causal, scale, q_doc=doc_ids, k_doc=k_doc_ids)
    if impl == "triton":
        from parallel3d.kernels import ops
        return ops.flash_attention(q, k, v, causal, scale)
    if impl == "library":   # the meta stand-in for SDPA's CUDA op with the lse (select_attention)
        from parallel3d.kernels.attention_standin import library_attention
        return library_attention(q, k, v, causal, scale, with_lse=True)
    if impl == "sdpa":      # aten's flash op, CPU or CUDA
        return SdpaBlockFunction.apply(q, k, v, causal, q.shape[-1] ** -0.5 if scale is None else scale)
    return attention_reference(q, k, v, causal, scale)
