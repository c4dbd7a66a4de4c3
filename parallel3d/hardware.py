"""Dense peak FLOP/s of accelerators, one table for the planner (parallel3d/planner/hardware.py) and the
run's MFU (parallel3d/training/metrics.py): an MFU the run logs and one the planner predicts share a
denominator.

Vendor datasheets, dense (no sparsity). fp32 is the non-tensor-core rate; tf32 the tensor-core rate fp32
matmuls get with `torch.backends.cuda.matmul.allow_tf32` (as Megatron runs them). Keys are lower-case
substrings of `torch.cuda.get_device_name()`, checked in order, so more specific names come first.
"""
from __future__ import annotations

from typing import Optional

PEAK_FLOPS: dict[str, dict[str, float]] = {
    "gh200": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 67e12, "fp64": 67e12},
    "h200": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 67e12, "fp64": 67e12},
    "h100 pcie": {"bf16": 756e12, "fp16": 756e12, "fp8": 1513e12, "tf32": 378e12, "fp32": 51e12, "fp64": 51e12},
    "h100": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 67e12, "fp64": 67e12},
    "h800": {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494.5e12, "fp32": 67e12, "fp64": 67e12},
    "b200": {"bf16": 2250e12, "fp16": 2250e12, "fp8": 4500e12, "tf32": 1100e12, "fp32": 80e12, "fp64": 40e12},
    "a100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12, "fp64": 19.5e12},
    "a800": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12, "fp64": 19.5e12},
    "l40s": {"bf16": 362e12, "fp16": 362e12, "tf32": 183e12, "fp32": 91.6e12},
    "a10g": {"bf16": 70e12, "fp16": 70e12, "tf32": 35e12, "fp32": 31.2e12},
    "v100": {"bf16": 125e12, "fp16": 125e12, "tf32": 15.7e12, "fp32": 15.7e12},
    "mi300x": {"bf16": 1307e12, "fp16": 1307e12, "tf32": 653e12, "fp32": 163e12},
}


def peak_flops_of(device_name: str, precision: str) -> Optional[float]:
    """Table peak for a device name (`torch.cuda.get_device_name()` or the planner's GPU name), or None."""
    name = device_name.lower()
    for key, rates in PEAK_FLOPS.items():
        if key in name:
            return rates.get(precision, rates["fp32"])
    return None
