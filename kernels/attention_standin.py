"""The meta stand-in's attention where a CUDA run takes a library kernel, not ours.

Without a log-sum-exp to return, attention on CUDA runs SDPA's flash kernels or the flash-attn package
(`attention_backend.select_attention`); with one (context-parallel blocks) it runs our Triton kernel. Both
save (out, lse) and skip the masked half of a causal square, so the dry run's shapes, saved tensors and
FLOPs are the same for either. Their speed is not: on an H200, SDPA's forward ran at 1.7x ours and its
backward at 1.8x (benchmarks/RESULTS.md, "Flash-attention tiles"). This op is our kernel's custom op
(`ops.flash_attention`) under its own name, so the planner prices each at its own measured rate
(`planner/hardware.py`, `GPU.attention_efficiency`). It runs only on `meta`.

    library_attention(q (b, s, hq, d), k, v (b, s, hk, d), causal, scale) -> (out (b, s, hq, d), lse (b, hq, s))
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op
from torch.utils.flop_counter import register_flop_formula

from parallel3d.kernels import ops


def _meta_only(*tensors: Tensor) -> None:
    if any(t.device.type != "meta" for t in tensors):
        raise RuntimeError("library_attention is the planner's stand-in on the meta device; a real tensor "
                           "takes kernels.dispatch.attention")


@custom_op("parallel3d::library_attention_fwd", mutates_args=())
def library_attention_fwd(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: Optional[float]
                          ) -> tuple[Tensor, Tensor]:
    _meta_only(q, k, v)
    raise AssertionError("unreachable: meta runs the fake")


@library_attention_fwd.register_fake
def _(q, k, v, causal, scale):
    _meta_only(q, k, v)
    b, sq, hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((b, hq, sq), dtype=torch.float32)   # (b, s, hq, d), (b, hq, s)


@custom_op("parallel3d::library_attention_bwd", mutates_args=())
def library_attention_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                          scale: Optional[float]) -> tuple[Tensor, Tensor, Tensor]:
    _meta_only(do, q, k, v)
    raise AssertionError("unreachable: meta runs the fake")


@library_attention_bwd.register_fake
def _(do, q, k, v, out, lse, causal, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    ctx.save_for_backward(q, k, v, *output)   # what a flash kernel keeps: inputs, out and lse, no scores
    ctx.args = (causal, scale)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = library_attention_bwd(dout, q, k, v, out, lse, *ctx.args)
    return dq, dk, dv, None, None


library_attention_fwd.register_autograd(_backward, setup_context=_setup)


# our kernel's formulas: the same matmuls over the visible causal pairs
register_flop_formula(torch.ops.parallel3d.library_attention_fwd)(ops.attention_fwd_flops)
register_flop_formula(torch.ops.parallel3d.library_attention_bwd)(ops.attention_bwd_flops)


def library_attention(q: Tensor, k: Tensor, v: Tensor, causal: bool = True, scale: Optional[float] = None
                      ) -> tuple[Tensor, Tensor]:
    return library_attention_fwd(q, k, v, causal, scale)
