"""The meta stand-in's attention where a CUDA run takes a library kernel, not ours.

Without a log-sum-exp to return, attention on CUDA runs SDPA's kernels or the flash-attn package
(`attention_backend.select_attention`); with one (context-parallel blocks) it runs SDPA's cuDNN op on Hopper
(`attention_backend.cuda_lse_op`; elsewhere FlashAttention-2's or our Triton kernel, whose stand-in is our
own op). All save (out, lse) and skip the masked half of a causal square, so the dry run's shapes, saved
tensors and FLOPs are the same for any. Their speed is not: on an H200, SDPA's attention ran at 0.58 of the
bf16 peak forward and 0.45 backward, cuDNN's CP block at 0.45 / 0.39, ours at 0.33 / 0.25
(benchmarks/RESULTS.md). These ops are our kernel's custom op (`ops.flash_attention`) under their own
names, so the planner prices each at its own measured rate (`planner/hardware.py`,
`GPU.attention_efficiency`). They run only on `meta`.

    library_attention(q (b, s, hq, d), k, v (b, s, hk, d), causal, scale, with_lse)
        -> (out (b, s, hq, d), lse (b, hq, s))
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op
from torch.utils.flop_counter import register_flop_formula

from parallel3d.kernels.flash_attention import attention_bwd_flops, attention_fwd_flops


def _meta_only(*tensors: Tensor) -> None:
    if any(t.device.type != "meta" for t in tensors):
        raise RuntimeError("library_attention is the planner's stand-in on the meta device; a real tensor "
                           "takes kernels.dispatch.attention")


def _define(name: str):
    """The stand-in op pair parallel3d::{name}_fwd / {name}_bwd, differentiable through the forward's out."""
    @custom_op(f"parallel3d::{name}_fwd", mutates_args=())
    def fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float]) -> tuple[Tensor, Tensor]:
        _meta_only(q, k, v)
        raise AssertionError("unreachable: meta runs the fake")

    @fwd.register_fake
    def _(q, k, v, causal, scale):
        _meta_only(q, k, v)
        b, sq, hq, _ = q.shape
        return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=torch.float32)   # (b, s, hq, d), (b, hq, s)

    @custom_op(f"parallel3d::{name}_bwd", mutates_args=())
    def bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
            scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
        _meta_only(do, q, k, v)
        raise AssertionError("unreachable: meta runs the fake")

    @bwd.register_fake
    def _(do, q, k, v, out, lse, causal, scale):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup(ctx, inputs, output):
        q, k, v, causal, scale = inputs
        ctx.save_for_backward(q, k, v, *output)   # what a flash kernel keeps: inputs, out and lse, no scores
        ctx.args = (causal, scale)

    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = bwd(dout, q, k, v, out, lse, *ctx.args)
        return dq, dk, dv, None, None

    fwd.register_autograd(backward, setup_context=setup)
    # our kernel's formulas: the same matmuls over the visible causal pairs
    register_flop_formula(getattr(torch.ops.parallel3d, f"{name}_fwd"))(attention_fwd_flops)
    register_flop_formula(getattr(torch.ops.parallel3d, f"{name}_bwd"))(attention_bwd_flops)
    return fwd, bwd


# attention without the lse (SDPA's kernel choice, or flash-attn's)
library_attention_fwd, library_attention_bwd = _define("library_attention")
# a context-parallel block with the lse (cuDNN's op: kernels/attention_backend.cuda_lse_op), slower than
# SDPA's own call at the same shape (the kv heads expanded for it, the lse returned)
library_lse_attention_fwd, library_lse_attention_bwd = _define("library_lse_attention")


def library_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: Optional[float] = None,
                      with_lse: bool = False) -> tuple[Tensor, Tensor]:
    """(out (b, s, hq, d), lse (b, hq, s)) of the stand-in of what CUDA runs: without the lse wanted SDPA's
    attention, with it a CP block's op; each has its own op name, so its own measured rate."""
    return (library_lse_attention_fwd if with_lse else library_attention_fwd)(q, k, v, causal, scale)
