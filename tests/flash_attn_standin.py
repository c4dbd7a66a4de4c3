"""Test-only stand-in for the flash-attn package (it has no CPU wheel): the two public functions our code calls,
`flash_attn_func` and `flash_attn_varlen_func`, with the signatures, layouts and checks that the package's
`flash_attn/flash_attn_interface.py` documents (flash-attn 2.x), computed with exact fp32 torch math.

What the package documents and this module enforces, so that a wrong call in our code fails a test:
  - q (b, sq, hq, d), k/v (b, sk, hk, d) for flash_attn_func; q (total_q, hq, d), k/v (total_k, hk, d) with
    cu_seqlens_q/k (n + 1,) int32 and max_seqlen_q/k for flash_attn_varlen_func;
  - fp16/bf16 only, q/k/v of one dtype, head dim <= 256, hq a multiple of hk (GQA: q heads
    [i * hq/hk, (i+1) * hq/hk) use kv head i);
  - softmax_scale defaults to d ** -0.5; causal is aligned to the bottom-right corner (query i sees keys
    j <= i + sk - sq); a row that sees no key gives zeros;
  - out has q's shape and dtype; with return_attn_probs=True the result is (out, softmax_lse, S_dmask),
    softmax_lse fp32 (b, hq, sq) for flash_attn_func and (hq, total_q) for the varlen entry.
Dropout, sliding windows, softcap and ALiBi are not used by our code and refused here.
Differentiable w.r.t. q, k, v (the package's functions are autograd Functions). Not installed on CUDA: the
real package is tested there (tests/test_flash_attn_backend.py, `gpu` mark).

`install(monkeypatch)` registers it as `flash_attn` in sys.modules (with a module spec, so
importlib.util.find_spec finds it) and records every call in `CALLS`.
"""
from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Optional

import torch

CALLS: list[tuple[str, tuple]] = []  # (function name, q shape) per call


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dims: int, name: str) -> None:
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise RuntimeError("query and key/value must have the same dtype")
    if q.dim() != dims or k.dim() != dims or v.dim() != dims:
        raise RuntimeError(f"{name}: q, k, v must be {dims}-D, got {q.dim()}, {k.dim()}, {v.dim()}")
    if k.shape != v.shape:
        raise RuntimeError(f"{name}: k and v must have one shape, got {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1] or q.shape[-1] > 256:
        raise RuntimeError(f"{name}: head dim must match and be <= 256, got {q.shape[-1]}, {k.shape[-1]}")
    if q.shape[-2] % k.shape[-2]:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def _refuse_extras(dropout_p, window_size, softcap, alibi_slopes) -> None:
    if dropout_p or tuple(window_size) != (-1, -1) or softcap or alibi_slopes is not None:
        raise NotImplementedError("the stand-in implements dropout_p=0, no window, no softcap, no ALiBi")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence: q (sq, hq, d), k/v (sk, hk, d) -> out (sq, hq, d) fp32, lse (hq, sq), probs (hq, sq, sk)."""
    sq, hq, _ = q.shape
    sk, hk, _ = k.shape
    group = hq // hk
    kf = k.float().repeat_interleave(group, dim=1)  # (sk, hq, d): q head h reads kv head h // group
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # (hq, sq, sk)
    if causal:
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)  # bottom-right aligned
        scores = scores.masked_fill(~visible.to(q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (hq, sq); -inf where a row sees no key
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0)[..., None])  # rows without keys: 0
    return torch.einsum("hqk,khd->qhd", probs, vf), lse, probs


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    _check(q, k, v, 4, "flash_attn_func")
    _refuse_extras(dropout_p, window_size, softcap, alibi_slopes)
    if q.shape[0] != k.shape[0]:
        raise RuntimeError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
    CALLS.append(("flash_attn_func", tuple(q.shape)))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    outs, lses, probs = zip(*(_attend(q[i], k[i], v[i], scale, causal) for i in range(q.shape[0])))
    out = torch.stack(outs).to(q.dtype)  # (b, sq, hq, d)
    if not return_attn_probs:
        return out
    return out, torch.stack(lses).detach(), torch.stack(probs).detach().to(q.dtype)  # lse (b, hq, sq) fp32


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    _check(q, k, v, 3, "flash_attn_varlen_func")
    _refuse_extras(dropout_p, window_size, softcap, alibi_slopes)
    if block_table is not None:
        raise NotImplementedError("the stand-in has no paged KV cache")
    for cu, total, longest, which in ((cu_seqlens_q, q.shape[0], max_seqlen_q, "q"),
                                      (cu_seqlens_k, k.shape[0], max_seqlen_k, "k")):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.device != q.device:
            raise RuntimeError(f"cu_seqlens_{which} must be a 1-D int32 tensor on q's device")
        lengths = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lengths < 0).any()):
            raise RuntimeError(f"cu_seqlens_{which} must rise from 0 to the {total} tokens, got {cu.tolist()}")
        if int(lengths.max()) > int(longest):
            raise RuntimeError(f"max_seqlen_{which}={longest} is below the longest sequence {int(lengths.max())}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise RuntimeError("cu_seqlens_q and cu_seqlens_k must describe the same number of sequences")
    CALLS.append(("flash_attn_varlen_func", tuple(q.shape)))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    outs, lses = [], []
    for i in range(cu_seqlens_q.numel() - 1):
        qs = slice(int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1]))
        ks = slice(int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1]))
        o, lse, _ = _attend(q[qs], k[ks], v[ks], scale, causal)
        outs.append(o)
        lses.append(lse)
    out = torch.cat(outs).to(q.dtype)  # (total_q, hq, d)
    if not return_attn_probs:
        return out
    return out, torch.cat(lses, dim=1).detach(), None  # lse (hq, total_q) fp32


def module(name: str = "flash_attn", **functions) -> types.ModuleType:
    """A module object named `name` holding the stand-in's functions (or replacements given by keyword)."""
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    mod.__version__ = "2.7.0+standin"
    mod.flash_attn_func = functions.get("flash_attn_func", flash_attn_func)
    mod.flash_attn_varlen_func = functions.get("flash_attn_varlen_func", flash_attn_varlen_func)
    return mod


def install(monkeypatch, mod: Optional[types.ModuleType] = None) -> types.ModuleType:
    """Register the stand-in (or `mod`) as the flash_attn package for this test; CALLS starts empty."""
    CALLS.clear()
    mod = module() if mod is None else mod
    monkeypatch.setitem(sys.modules, "flash_attn", mod)
    return mod
