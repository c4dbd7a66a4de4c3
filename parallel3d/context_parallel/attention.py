"""Attention over a sequence sharded across the CP group (ring / all-gather / Ulysses)."""
from __future__ import annotations

import torch

from kernels import dispatch
from parallel3d.comm import Group


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, mode: str = "ring",
                               causal: bool = True, backend: str = "auto") -> torch.Tensor:
    """q (b, s/cp, hq, d), k/v (b, s/cp, hk, d) local shards -> out (b, s/cp, hq, d)."""
    if group.size == 1:
        return dispatch.attention(q, k, v, causal=causal, backend=backend)
    raise NotImplementedError("context parallelism (cp > 1) is not implemented yet")
