"""Rotary position embedding (rotate-half convention, as Hugging Face Llama), positions explicit."""
from __future__ import annotations

import math
from typing import Optional

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: Optional[dict] = None) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in fp32, with optional Llama-3 frequency scaling.

    scaling: {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling:
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (s,) or (b, s) int -> cos, sin of shape positions.shape + (head_dim,) in fp32."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # (..., d/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (..., d)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (b, s, hq, d), k (b, s, hk, d), cos/sin (s, d) or (b, s, d) -> rotated q, k (same dtypes)."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # (b|1, s, 1, d)
    q_out = (q.float() * cos + _rotate_half(q.float()) * sin).to(q.dtype)
    k_out = (k.float() * cos + _rotate_half(k.float()) * sin).to(k.dtype)
    return q_out, k_out
