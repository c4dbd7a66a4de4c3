"""SDPA's CUDA ops that return the log-sum-exp and have a backward from a given (out, lse): what a
context-parallel block (ring attention, Ulysses with the lse) runs on CUDA (attention_backend.py).

    cuda_lse_op(q) -> "cudnn" | "flash" | ""       which op runs q (b, s, h, d); "" leaves our Triton kernel
    cuda_flash(q, k, v, causal, scale) -> (out (b, sq, hq, d), lse (b, hq, sq) fp32)
    cuda_flash_backward(do, q, k, v, out, lse, causal, scale) -> (dq, dk, dv), this block's share of the
        gradient given the merged out and lse of its rows (context_parallel/blocks.py)

q (b, sq, hq, d), k/v (b, sk, hk, d), hq % hk == 0 (GQA). Causal is the op's own alignment: callers pass
causal only for square blocks (attention_backend.sdpa_attention_with_lse splits the rest).
"""
from __future__ import annotations

import torch


def bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)  # (b, s, h, d) <-> (b, h, s, d): the aten ops' layout


def cuda_lse_op(q: torch.Tensor) -> str:
    """Which of SDPA's CUDA ops runs a block that returns its lse (CP), for q (b, s, h, d):
      "cudnn"  `_scaled_dot_product_cudnn_attention`, the kernel SDPA itself takes on Hopper. As a GQA block
               (its kv heads expanded: it refuses GQA) it ran 0.32-0.51 of the bf16 peak forward and
               0.25-0.47 backward on an H200, 1.2-1.6x and 1.5-1.9x ours (benchmarks/RESULTS.md);
      "flash"  FlashAttention-2 inside PyTorch, `_scaled_dot_product_flash_attention`: about our kernel's
               rate there, but GQA-native, on any sm_80+ GPU and head dims up to 256;
      ""       neither: our Triton kernel.
    Both take 16-bit inputs and head dims that are multiples of 8, return the lse and have a backward from
    a given (out, lse). On `meta` (the dry run stands for a Hopper GPU) only the dtype and head dim count."""
    d = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or d % 8 or d > 256:
        return ""
    major = torch.cuda.get_device_capability(q.device)[0] if q.is_cuda else 9
    if major >= 9 and d <= 128 and (not q.is_cuda or _cudnn_attention_on()):
        return "cudnn"
    return "flash" if major >= 8 else ""


def _cudnn_attention_on() -> bool:
    """SDPA's cuDNN attention is switched on and the cuDNN torch carries has it (9.x: the op and its
    backward from a given (out, lse))."""
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return torch.backends.cuda.cudnn_sdp_enabled() and version is not None and version >= 90000


def _expand_heads(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """k or v (b, s, hk, d) -> (b, s, hq, d): cuDNN's op takes as many kv heads as query heads."""
    rep = q.shape[2] // x.shape[2]
    return x.repeat_interleave(rep, dim=2) if rep > 1 else x


def cuda_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    if cuda_lse_op(q) == "cudnn":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            bhsd(q), bhsd(_expand_heads(q, k)), bhsd(_expand_heads(q, v)), None, True, 0.0, causal, False,
            scale=scale)  # (b, hq, sq, d), (b, hq, sq, 1) fp32
        return bhsd(out), lse.squeeze(-1)
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        bhsd(q), bhsd(k), bhsd(v), 0.0, causal, scale=scale)  # (b, hq, sq, d), (b, hq, sq) fp32; GQA native
    return bhsd(out), lse


def cuda_flash_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, causal: bool, scale: float
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # no dropout: the philox state is not read, but the ops take tensors shaped as their forwards return
    # them; no cumulative lengths (None): the dense, not the varlen, kernels
    sq, sk = q.shape[1], k.shape[1]
    if cuda_lse_op(q) == "cudnn":
        b, _, hk, d = k.shape
        seed = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            bhsd(do), bhsd(q), bhsd(_expand_heads(q, k)), bhsd(_expand_heads(q, v)), bhsd(out),
            lse.float().unsqueeze(-1).contiguous(), seed, seed, None, None, None, sq, sk, 0.0, causal,
            scale=scale)  # (b, hq, sq, d), (b, hq, sk, d) x2
        rep = q.shape[2] // hk
        # GQA: q heads [i*rep, (i+1)*rep) share kv head i -> sum their contributions
        dk, dv = (bhsd(t).reshape(b, sk, hk, rep, d).sum(3) if rep > 1 else bhsd(t) for t in (dk, dv))
        return bhsd(dq), dk, dv
    seed = torch.empty(2, dtype=torch.uint64, device=q.device)
    offset = torch.empty((), dtype=torch.uint64, device=q.device)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        bhsd(do), bhsd(q), bhsd(k), bhsd(v), bhsd(out), lse.float().contiguous(), None, None,
        sq, sk, 0.0, causal, seed, offset, scale=scale)  # (b, hq, sq, d), (b, hk, sk, d) x2
    return bhsd(dq), bhsd(dk), bhsd(dv)
