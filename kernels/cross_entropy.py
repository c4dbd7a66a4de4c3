"""Token cross-entropy over a (possibly partial) vocabulary."""
from __future__ import annotations

import torch


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100
                            ) -> torch.Tensor:
    """logits (n, v), target (n,) -> per-token loss (n,) fp32, 0 where target == ignore_index."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)  # (n,)
    valid = target != ignore_index
    safe = torch.where(valid, target, torch.zeros_like(target))
    picked = logits.gather(-1, safe[:, None]).squeeze(-1)  # (n,)
    return torch.where(valid, lse - picked, torch.zeros_like(lse))
