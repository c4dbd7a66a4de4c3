"""AdamW on a bucket's flat fp32 state: the update each rank applies to the segment it holds.

One update (`adamw_flat_`) serves every home of the state: the device, host memory (offload cpu) and the
chunks streamed from NVMe (offload/nvme.py), so all of them are bit-identical. It is torch.optim.AdamW's
single-tensor arithmetic (decay, lerp, addcmul, sqrt/div/add, addcdiv) run over cache-sized blocks.
benchmarks/offload.py (RESULTS.md) measured the CPU candidates: this blocked form, torch's single-tensor
and foreach AdamW are equal to the bit and within noise of each other (this one a little ahead);
torch's fused CPU AdamW, a torch.compile'd loop and DeepSpeedCPUAdam are 2-10x faster but round
differently, so they are not used: the offloaded run must equal the run without offload.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from parallel3d.data_parallel.buffer import Bucket

BLOCK = 1 << 17  # elements per block on the CPU: p, m, v, g and one temporary (5 x 512 KiB) stay in cache
# On a GPU each block is ~7 kernel launches, so CPU-sized blocks were launch-bound: a 1.2B model spent
# ~0.45 s per step in AdamW on an H200 (9,400 blocks) against ~20 ms of memory traffic. 16M elements per
# block (a 64 MiB temporary) makes the launches negligible; the update is elementwise, so any block size
# gives the same bits.
DEVICE_BLOCK = 1 << 24


def block_for(device: torch.device) -> int:
    """Elements per AdamW block on `device` (the meta stand-in is priced as the GPU it stands for; a plan
    of a CPU run sets train.adamw_block to the CPU's, planner/host_kernels.py)."""
    return BLOCK if device.type == "cpu" else DEVICE_BLOCK


def check_block(block: int) -> None:
    """train.adamw_block: 0 (by device) or a positive number of elements."""
    if block < 0:
        raise ValueError(f"train.adamw_block must be 0 (by device) or a positive number of elements, got {block}")


def decay_ranges(b: Bucket) -> list[tuple[int, int]]:
    """[start, end) element ranges of the held segment whose parameters take weight decay."""
    return [(s.h_seg, s.h_seg + s.h_len) for s in b.slots if s.decay and s.h_len]


@torch.no_grad()
def adamw_flat_(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
                decayed: Sequence[tuple[int, int]], lr: float, betas: tuple[float, float], eps: float,
                weight_decay: float, step: int, block: Optional[int] = None) -> None:
    """In place on flat fp32 p, m, v (same length as grad); `decayed`: ranges (relative to p) to decay."""
    if weight_decay:
        for a, e in decayed:
            if e > a:
                p[a:e].mul_(1 - lr * weight_decay)
    beta1, beta2 = betas
    step_size = lr / (1 - beta1 ** step)
    bc2_sqrt = math.sqrt(1 - beta2 ** step)
    n = p.numel()
    block = block or block_for(p.device)
    scratch = torch.empty(min(block, n), dtype=torch.float32, device=p.device)
    for i in range(0, n, block):
        sl = slice(i, min(i + block, n))
        g = grad[sl] if grad.dtype == torch.float32 else grad[sl].float()
        mb, vb = m[sl], v[sl]
        denom = scratch[: sl.stop - sl.start]
        mb.lerp_(g, 1 - beta1)
        vb.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        torch.sqrt(vb, out=denom)
        denom.div_(bc2_sqrt).add_(eps)
        p[sl].addcdiv_(mb, denom, value=-step_size)


def clip_ranges(ranges: Sequence[tuple[int, int]], a: int, e: int) -> list[tuple[int, int]]:
    """`ranges` intersected with [a, e), shifted to start at a."""
    return [(max(x, a) - a, min(y, e) - a) for x, y in ranges if x < e and y > a]


@torch.no_grad()
def adamw_(b: Bucket, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
           step: int, grad: Optional[torch.Tensor] = None, block: Optional[int] = None,
           ranges: Optional[Sequence[tuple[int, int]]] = None) -> None:
    """torch.optim.AdamW's single-tensor update on the bucket's resident flat fp32 state (padding stays 0).
    ranges: only these [start, stop) ranges of the held segment (the rest is Muon's, muon_step.py)."""
    grad = b.grad.shard if grad is None else grad  # offload: a host copy of the held gradient
    if ranges is None:
        adamw_flat_(b.adam.master, b.adam.exp_avg, b.adam.exp_avg_sq, grad, decay_ranges(b), lr, betas, eps,
                    weight_decay, step, block)
        return
    a_ = b.adam
    for a, e in ranges:   # elementwise: the same bits as one pass over the segment
        adamw_flat_(a_.master[a:e], a_.exp_avg[a:e], a_.second_moment(a, e), grad[a:e],
                    clip_ranges(decay_ranges(b), a, e), lr, betas, eps, weight_decay, step, block)


OFFLOAD_MODES = ("none", "cpu", "nvme")


def check_offload(optimizer: str, params: str = "none", zero: int = 0, offload_dir: Optional[str] = None,
                  buffer_mb: float = 64.0) -> None:
    """parallel.offload_optimizer / offload_params / offload_dir / offload_buffer_mb.

    optimizer: none | cpu (fp32 master and Adam state in host memory, AdamW on the CPU) | nvme (the same
    state in files under offload_dir, streamed through offload_buffer_mb of host buffers). params: none |
    cpu | nvme, ZeRO-3 only (the persistent parameter shard lives off the device between uses)."""
    for key, mode in (("offload_optimizer", optimizer), ("offload_params", params)):
        if mode not in OFFLOAD_MODES:
            raise ValueError(f"parallel.{key}={mode!r} is not one of {', '.join(OFFLOAD_MODES)}")
    if params != "none" and zero != 3:
        raise ValueError(f"parallel.offload_params={params} needs parallel.zero=3 (only ZeRO-3 keeps a parameter "
                         f"shard that can live off the device between uses), got zero={zero}")
    if "nvme" in (optimizer, params) and not offload_dir:
        raise ValueError("parallel.offload_optimizer/offload_params=nvme needs parallel.offload_dir=DIR "
                         "(a directory on a fast local disk)")
    if "nvme" in (optimizer, params):
        from parallel3d.offload.files import check_offload_dir
        check_offload_dir(offload_dir)
    if not buffer_mb > 0:
        raise ValueError(f"parallel.offload_buffer_mb must be > 0, got {buffer_mb}")


def check_offload_device(optimizer: str, params: str, device: torch.device) -> None:
    """Offload needs real host memory: the meta-device stand-in (the planner's dry run) has none."""
    if device.type == "meta" and (optimizer, params) != ("none", "none"):
        raise ValueError("offload needs host memory, which the meta-device stand-in has no values for: the "
                         "planner dry-runs the device step without it (parallel3d/planner/offload.py)")
