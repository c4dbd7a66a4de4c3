"""The Triton launches our launchers make, recorded instead of run (for benchmarks/kernel_report.py).

Each launcher (rmsnorm_forward, flash_attention_backward, ...) is called on small CPU tensors with
`JITFunction.run` replaced by a recorder, so what is compiled is exactly what the launcher chooses
(constexprs, dtypes, block sizes, num_warps, num_stages) for each dtype and shape class, and nothing runs.
Attention's tiles depend on the architecture (kernels/_flash_common.py), so launches are recorded per
target arch, that arch standing in for the device's compute capability.
"""
from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.runtime.jit import JITFunction, mangle_type  # noqa: E402

ATTENTION_KERNELS = ("_attn_fwd_kernel", "_attn_bwd_delta_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel")
# head dims of the attention variants: one per row of the launchers' tile table (64, 128, above 128)
ATTENTION_HEAD_DIMS = (64, 128, 256)
TMA_HEAD_DIMS = (64, 128)  # head dims whose 16-bit sm_90 attention variants are also compiled with TMA loads
_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.bool: "i1", torch.uint8: "u8"}
FP8_ARCH = 89  # float8 conversions (train.fp8's casts) need sm_89+: compiled for the report's archs from here


@dataclass
class Launch:
    kernel: JITFunction
    variant: str
    signature: dict[str, str]
    constexprs: dict[str, Any]
    options: dict[str, int] = field(default_factory=dict)


def _signature(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict[str, str], dict[str, Any]]:
    sig, consts = {}, {}
    values = dict(zip([p.name for p in fn.params], args))
    values.update({k: v for k, v in kwargs.items() if k in {p.name for p in fn.params}})
    values.update({p.name: p.default for p in fn.params if p.name not in values and p.has_default})
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr or v is None:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TYPES[v.dtype]
        elif type(v).__name__ == "TensorDescriptor":  # TMA: tensordesc<bf16[1, 64, 1, 128]>
            sig[p.name] = mangle_type(v)
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i64" if abs(v) >= 2 ** 31 else "i32"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {p.name}={v!r}")
    return sig, consts


@contextlib.contextmanager
def recording(variant: str, into: list[Launch], arch: int = 80) -> Iterator[None]:
    """Launches inside are recorded, not run; the launchers see a device of compute capability `arch`."""
    from parallel3d.kernels import _flash_common

    original, capability = JITFunction.run, _flash_common.device_capability

    def record(self, *args, grid, warmup, **kwargs):
        sig, consts = _signature(self, args, kwargs)
        opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
        into.append(Launch(self, variant, sig, consts, opts))

    JITFunction.run = record
    _flash_common.device_capability = lambda device: arch
    try:
        yield
    finally:
        JITFunction.run = original
        _flash_common.device_capability = capability


def attention_launches(arch: int, dtypes: list, head_dims: tuple, masks: tuple = (True, False),
                       tma_head_dims: tuple = TMA_HEAD_DIMS) -> list[Launch]:
    """The flash-attention launches (forward, delta, dK/dV, dQ), plain and document-masked, per dtype, head
    dim and mask (causal / full) as the launchers choose them for `arch`; on sm_90+ the 16-bit ones at
    tma_head_dims also with the tensor-descriptor loads (variants ending " tma"), whether or not
    _flash_common.TMA_16BIT takes them yet, so that path is held to the same budget before a GPU picks it.
    Not at d=256: its TMA forward keeps 168 B of stack on sm_90, so TMA_16BIT offers no row above 128."""
    from parallel3d.kernels import _flash_common
    from parallel3d.kernels.flash_attention import flash_attention_backward, flash_attention_forward

    out: list[Launch] = []
    every = frozenset((k, c) for k in ("fwd", "dkdv", "dq") for c in tma_head_dims)
    for dt in dtypes:
        for d in head_dims:
            ways = [("", frozenset())]
            if arch >= 90 and dt in (torch.bfloat16, torch.float16) and d in tma_head_dims:
                ways.append((" tma", every))
            for causal, (suffix, tma_rows) in ((c, w) for c in masks for w in ways):
                qq, kk = torch.zeros(1, 64, 8, d, dtype=dt), torch.zeros(1, 64, 2, d, dtype=dt)
                lse = torch.zeros(1, 8, 64)
                doc = torch.zeros(1, 64, dtype=torch.int32)  # packed documents (document-masked varlen)
                kept, _flash_common.TMA_16BIT = _flash_common.TMA_16BIT, tma_rows
                try:
                    with recording(f"{_TYPES[dt]} d={d} {'causal' if causal else 'full'}{suffix}", out, arch):
                        flash_attention_forward(qq, kk, kk, causal)
                        flash_attention_backward(qq, qq, kk, kk, qq, lse, causal)
                    with recording(f"{_TYPES[dt]} d={d} {'causal' if causal else 'full'} docs{suffix}", out, arch):
                        flash_attention_forward(qq, kk, kk, causal, q_doc=doc, k_doc=doc)
                        flash_attention_backward(qq, qq, kk, kk, qq, lse, causal, q_doc=doc, k_doc=doc)
                finally:
                    _flash_common.TMA_16BIT = kept
    return out


def launches(quick: bool = False, arch: int = 80, attention_only: bool = False) -> list[Launch]:
    """Every launch the launchers make for `arch` over the dtypes and shape classes they distinguish."""
    from parallel3d.kernels.cross_entropy import cross_entropy_partial_grad, cross_entropy_partial_stats
    from parallel3d.kernels.grouped_gemm import grouped_mm_forward, grouped_mm_weight_grad
    from parallel3d.kernels.rmsnorm import rmsnorm_backward, rmsnorm_forward
    from parallel3d.kernels.rope import rope_apply
    from parallel3d.kernels.swiglu import swiglu_backward, swiglu_forward

    dtypes = [torch.bfloat16] if quick else [torch.float32, torch.bfloat16, torch.float16]
    out = attention_launches(arch, dtypes, ATTENTION_HEAD_DIMS, (True,) if quick else (True, False))
    if attention_only:
        return out
    for dt in dtypes:
        t = _TYPES[dt]
        for h in ([4096] if quick else [1024, 4096, 8192]):
            x, w = torch.zeros(2, h, dtype=dt), torch.zeros(h, dtype=dt)
            with recording(f"{t} h={h}", out, arch):
                _, s, rstd = rmsnorm_forward(x, w, 1e-5)
                rmsnorm_forward(x, w, 1e-5, residual=x)
                rmsnorm_backward(x, x, w, rstd)
                rmsnorm_backward(x, x, w, rstd, d_residual_out=x)
                swiglu_forward(x, x)
                swiglu_backward(x, x, x)
        for d in ([128] if quick else [64, 128]):
            q, k = torch.zeros(1, 4, 8, d, dtype=dt), torch.zeros(1, 4, 2, d, dtype=dt)
            cos = torch.zeros(4, d, dtype=torch.float32)
            with recording(f"{t} d={d}", out, arch):
                rope_apply(q, k, cos, cos)
                rope_apply(q, k, cos, cos, backward=True)
            q, k = torch.zeros(1, 4096, 32, d, dtype=dt), torch.zeros(1, 4096, 8, d, dtype=dt)  # 4 tokens/program
            cos = torch.zeros(4096, d, dtype=torch.float32)
            with recording(f"{t} d={d} hq32 hk8 s4096", out, arch):
                rope_apply(q, k, cos, cos)
                rope_apply(q, k, cos, cos, backward=True)
        x, w, counts = torch.zeros(96, 512, dtype=dt), torch.zeros(4, 256, 512, dtype=dt), [40, 0, 50, 6]
        with recording(f"{t} experts 4x(256,512)", out, arch):
            y = grouped_mm_forward(x, w, counts)  # (96, 256)
            grouped_mm_forward(y, w, counts, transpose_b=False)  # dX
            grouped_mm_weight_grad(y, x, counts)  # dW
        logits, target = torch.zeros(4, 32000, dtype=dt), torch.zeros(4, dtype=torch.int64)
        with recording(f"{t} vocab/tp=32000", out, arch):
            cross_entropy_partial_stats(logits, target, 0)
            cross_entropy_partial_grad(logits, target, 0, torch.zeros(4), torch.zeros(4))
        if arch >= FP8_ARCH:
            out += fp8_launches(arch, dt, quick)
    return out


def fp8_launches(arch: int, dt: torch.dtype, quick: bool) -> list[Launch]:
    """train.fp8's casts (kernels/fp8_cast.py): tensorwise amax + scale-cast, rowwise fused one pass (rows:
    forward; columns: the weight-gradient GEMM's operands) and amax + given-amax cast (TP-reduced), for e4m3
    and e5m2 (tensorwise gradients); --quick: the forward's casts. h=14336 rows take the two-loop path."""
    from parallel3d.kernels import fp8_cast as fc

    out: list[Launch] = []
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    for h in ([4096] if quick else [4096, 14336]):
        x = torch.zeros(4, h, dtype=dt)
        with recording(f"{_TYPES[dt]} fp8 h={h}", out, arch):
            amax = fc.amax_tensor(x)
            fc.scale_cast(x, amax, e4)
            fc.cast_axis(x, 1, e4)
            if not quick:
                fc.scale_cast(x, amax, e5)
                fc.cast_axis(x, 0, e4)
                fc.cast_axis(x, 1, e4, amax=fc.amax_axis(x, 1))
                fc.scale_cast(x, amax, e4, col_major=True)    # dW's x (tensorwise)
                fc.cast_axis(x, 0, e4, col_major=True)         # dW's x and dy^T (rowwise)
    return out
