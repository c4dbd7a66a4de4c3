"""What the planner knows of our Triton kernels on real GPUs: their theoretical occupancy, from the
ahead-of-time compile report (`python benchmarks/kernel_report.py --arch 80 90 100 --planner-table
parallel3d/planner/kernel_occupancy.json`), used to derate the roofline of the ops they run.

Derating rule: a kernel reaches its roofline only with enough warps resident per SM to hide latency. A
tensor-core kernel needs two warpgroups (8 warps) per SM so that one issues matrix instructions while the
other loads and runs the softmax (the ping-pong of FlashAttention-3 on Hopper; the same count keeps
Ampere's four schedulers busy with two warps each), so its time is divided by min(1, warps per SM / 8).
On `meta` our kernels run as their custom ops (kernels/ops.py); only attention's are derated here (the
norms, RoPE and SwiGLU are bandwidth-bound and need no tensor cores), and only on a GPU without measured
attention rates (`GPU.attention_efficiency`, which include what occupancy costs).
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Optional

TABLE = Path(__file__).with_name("kernel_occupancy.json")
WARPS_TO_SATURATE = 8
# the dry run's op (kernels/ops.py custom ops) -> the Triton kernels that do its work on a GPU
KERNELS_OF_OP = {"flash_attention_fwd": ("_attn_fwd_kernel",),
                 "flash_attention_bwd": ("_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel")}
CAUSAL_ARG = {"flash_attention_fwd": 3, "flash_attention_bwd": 6}  # position of `causal` in the op's args
ARCH_OF_GPU = {"A100-SXM4-80GB": 80, "H100-SXM5-80GB": 90, "H200-SXM-141GB": 90, "B200-SXM-180GB": 100}
_DTYPE = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


@lru_cache(maxsize=1)
def _table() -> dict:
    return json.loads(TABLE.read_text()) if TABLE.exists() else {}


def occupancy_factor(gpu_name: str, op: str, dtype: str, head_dim: int, causal: bool) -> Optional[tuple[float, dict]]:
    """(factor in (0, 1], {kernel: warps per SM}) for an op that one of our kernels runs, else None."""
    kernels = KERNELS_OF_OP.get(op)
    arch = ARCH_OF_GPU.get(gpu_name)
    rows = _table().get(str(arch), {})
    if kernels is None or not rows:
        return None
    warps = {}
    for kernel in kernels:
        variants = rows.get(kernel, {})
        best = _variant(variants, _DTYPE.get(dtype, "bf16"), head_dim, causal)
        if best is not None:
            warps[kernel] = best["ctas_per_sm"] * best["num_warps"]
    if not warps:
        return None
    return min(1.0, min(warps.values()) / WARPS_TO_SATURATE), warps


def _variant(variants: dict, dtype: str, head_dim: int, causal: bool) -> Optional[dict]:
    """The variant for this dtype and mask with the smallest compiled head dim >= head_dim (else the largest)."""
    found = []
    for name, row in variants.items():
        m = re.fullmatch(r"(\w+) d=(\d+) (causal|full)", name)  # not the "... docs" variants
        if m and m.group(1) == dtype and (m.group(3) == "causal") == causal:
            found.append((int(m.group(2)), row))
    if not found:
        return None
    found.sort(key=lambda x: x[0])
    return next((row for d, row in found if d >= head_dim), found[-1][1])
