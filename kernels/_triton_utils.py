"""Small host-side helpers shared by the Triton launch functions (no kernels live here).

Why they exist: the Triton interpreter (TRITON_INTERPRET=1, our CPU test path) computes bf16/fp16 math
wrongly (docs/architecture.md section 2.8), so kernels take the dtype they compute in as a `tl.constexpr` chosen here:
fp32 for 16-bit inputs (and always under the interpreter), fp64 for fp64 inputs so `gradcheck` works.
"""
from __future__ import annotations

import os

import torch
import triton.language as tl
from torch.utils._python_dispatch import _get_current_dispatch_mode


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct(*tensors: torch.Tensor) -> bool:
    """Whether an eager call may run a kernel's launchers (or its autograd Function) instead of its
    `torch.library` custom op: plain tensors off `meta`, and nothing that reads the op graph active (not
    compiling, no dispatch mode such as FakeTensorMode or the planner's StepTracker, no profiler, whose op
    names step_profile.py reads). The custom-op layer costs host time on every call (kernels/ops.py; RESULTS.md,
    "Host cost of our kernel ops") and exists for those watchers."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None \
            or torch.autograd.profiler._is_profiler_enabled:
        return False
    return all(type(t) in _PLAIN and not t.is_meta for t in tensors)


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter instead of compiling them."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def tl_dtype(dtype: torch.dtype) -> tl.dtype:
    """The Triton dtype matching a torch floating dtype."""
    if dtype == torch.float32:
        return tl.float32
    if dtype == torch.bfloat16:
        return tl.bfloat16
    if dtype == torch.float16:
        return tl.float16
    if dtype == torch.float64:
        return tl.float64
    raise TypeError(f"unsupported dtype for a Triton kernel: {dtype}")


def acc_dtype(*dtypes: torch.dtype) -> tl.dtype:
    """Accumulation / elementwise-math dtype: fp64 if any input is fp64, otherwise fp32."""
    return tl.float64 if torch.float64 in dtypes else tl.float32


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype for `tl.dot`: the input's own 16-bit type on a GPU (tensor cores), fp32 under the
    interpreter (whose bf16 matmul is wrong), fp64 for fp64 inputs."""
    if dtype == torch.float64:
        return tl.float64
    if interpreting():
        return tl.float32
    return tl_dtype(dtype)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (block sizes must be powers of two). Plain integer arithmetic: Triton's own
    `triton.next_power_of_2` and `triton.cdiv` are constexpr functions whose host call costs microseconds,
    and every launch makes several (a third of RoPE's launch preparation on this CPU)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) of non-negative integers (grid sizes); see next_pow2."""
    return -(-a // b)


def num_programs_hint(device: torch.device) -> int:
    """How many persistent programs to launch for row-partial reductions: a few per SM on GPU; a
    handful under the interpreter, where each program runs sequentially anyway."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """View x (..., h) as (rows, h) with unit stride in the last dim, copying only when necessary."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.shape[-1] > 1 and x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2
