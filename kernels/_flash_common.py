"""What the flash-attention forward (flash_attention.py) and backward (flash_attention_bwd.py) kernels share:
the document-id tile test, tile configurations, argument checks and dtypes."""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from parallel3d.kernels._triton_utils import acc_dtype, dot_dtype, interpreting, next_pow2


@triton.jit
def _doc_block(DOC, idx, n):
    """Document ids of positions idx (< n valid) and their [min, max] over the valid ones. Ids are >= 0;
    padding rows get -1 so they match no key (keys pad with -2)."""
    d = tl.load(DOC + idx, mask=idx < n, other=-1)  # (BLOCK,) int32
    lo = tl.min(tl.where(idx < n, d, 2147483647), axis=0)
    hi = tl.max(d, axis=0)
    return d, lo, hi


def _config(d: int, dtype: torch.dtype, block_m: Optional[int], block_n: Optional[int], backward: bool
            ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Candidates come from the ahead-of-time compile report
    (benchmarks/kernel_report.py; RESULTS.md "Kernels on sm_80 / sm_90"): tiles that use tensor cores and
    spill nothing on sm_80 and sm_90. Among those, 16-bit d <= 128 takes what ran fastest on one H200
    (benchmarks/attention_tiles.py: (64, 64) on 4 warps, forward 3 stages, backward 2, ran 2.2x the 8-warp
    tiles chosen on paper). No autotune: the choice must be the same on every rank and every run."""
    if interpreting():
        bm, bn, warps, stages = 16, 16, 4, 1
    elif backward:  # dK/dV and dQ tiles: the largest that keep registers < 255 with no spill on sm_80/90
        bm, bn = (64, 32) if d <= 64 else (32, 64) if d <= 128 else (16, 32)
        warps, stages = (4 if d <= 64 else 8), 2
    else:           # (128, 64) spilled on sm_90 (160 B at d=64, 24 B at d=128: benchmarks/kernel_report.py)
        bm, bn = (64, 32) if d <= 64 else (64, 64) if d <= 128 else (32, 32)
        warps, stages = (4 if d <= 64 else 8), (3 if d <= 64 else 2)
    if dtype in (torch.float32, torch.float64) and not interpreting():
        bm, bn = max(bm // 2, 16), max(bn // 2, 16)
        if backward:  # fp32 dK/dV kept 32-560 B on the stack at 255 registers: narrower key tiles, 8 warps
            bn, warps = (16 if d > 64 else bn), 8
    elif 64 < d <= 128 and not interpreting():  # measured on the H200 (docstring)
        bm, bn, warps, stages = 64, 64, 4, (2 if backward else 3)
    return (next_pow2(block_m) if block_m else bm), (next_pow2(block_n) if block_n else bn), warps, stages


def _prep(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != q.shape[3]:
        raise ValueError(f"expected q (b, sq, hq, d), k/v (b, sk, hk, d); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads {q.shape[2]} not a multiple of kv heads {k.shape[2]}")


def _docs(q_doc: Optional[torch.Tensor], k_doc: Optional[torch.Tensor], q: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel arguments for document ids: contiguous int32 (b, sq) / (b, sk), or q itself as an unused
    placeholder pointer when there are none (HAS_DOC=False). Ids must be >= 0 (padding uses -1 / -2).
    Block skipping compares id ranges, so it is only a shortcut; the per-pair equality test is exact."""
    if q_doc is None:
        if k_doc is not None:
            raise ValueError("k_doc given without q_doc")
        return q, q
    k_doc = q_doc if k_doc is None else k_doc
    if q_doc.shape != q.shape[:2]:
        raise ValueError(f"q_doc must be (b, sq) = {tuple(q.shape[:2])}, got {tuple(q_doc.shape)}")
    return q_doc.to(torch.int32).contiguous(), k_doc.to(torch.int32).contiguous()


def _kernel_dtypes(q: torch.Tensor) -> dict:
    return dict(DOT=dot_dtype(q.dtype), ACC=acc_dtype(q.dtype),
                PREC="ieee" if q.dtype in (torch.float32, torch.float64) else "tf32")
