"""Multi-Latent Attention (DeepSeek-V2/V3), built from parallel3d layers (`model.attention_type=mla`).

Per token x (h), with heads n, latent ranks r_q (q_lora_rank) and r_kv (kv_lora_rank), per-head dims
d_nope (qk_nope_head_dim), d_rope (qk_rope_head_dim), d_v (v_head_dim):

    c_q  = norm(W_qa x)                       (r_q)        q = W_qb c_q      -> n x [q_nope (d_nope) | q_rot (d_rope)]
                                                            (r_q = 0: q = W_q x)
    [c_kv | k_r] = W_kva x                    (r_kv + d_rope)
    c_kv = norm(c_kv)                                       W_kvb c_kv      -> n x [k_nope (d_nope) | v (d_v)]
    q_rot, k_r = RoPE(q_rot), RoPE(k_r)       k_r is ONE key shared by every head (decoupled RoPE)
    q_h = [q_nope_h | q_rot_h],  k_h = [k_nope_h | k_r],  out = W_o concat_h softmax(q_h k_h^T * scale) v_h

scale = (d_nope + d_rope) ** -0.5, times mscale(factor, mscale_all_dim)^2 under YaRN RoPE scaling (and YaRN's
attention factor multiplies cos/sin), as DeepSeek-V3 and transformers' DeepseekV3Attention do. The latent
norms use eps 1e-6 whatever model.norm_eps is (as DeepSeek's code and transformers do).

Tensor parallelism. Heads are split: the up-projections from the latents to per-head q/k/v (W_qb, W_kvb, or
W_q) are column-parallel and W_o is row-parallel, exactly like Megatron attention. The down-projections to
the latents (W_qa, W_kva, including the RoPE key) and their norms are *replicated*: they are small
(h x (r_q + r_kv + d_rope) = 7168 x 2112 in V3) and every head needs the whole latent, so splitting them would
only add a gather. They run on the block input as it arrives, and the latent, not x, enters the TP region:
with SP the all-gather moves r_q + r_kv + d_rope values per token instead of h (2112 vs 7168 in V3), and
without SP the backward all-reduce is on the latent's gradient. Their weight gradients are therefore whole
(no SP: every rank holds all tokens and the all-reduced latent gradient) or partial over TP (SP: each rank
holds its own tokens), so they carry grad_reduce=("tp",) exactly when the norm weights do (RMSNorm's rule).

Context parallelism runs ring / all-gather / Ulysses over the *decompressed* per-head k/v: the CP kernels
(parallel3d.context_parallel) consume per-head k and v of equal width and merge partial results by the
log-sum-exp. Passing the latent (r_kv + d_rope per token, far less traffic) around the ring would need
W_kvb applied inside every ring step, forward and backward, i.e. a different kernel. When d_v differs
from d_nope + d_rope, v is zero-padded to the q/k width (or q/k to v's: zero columns leave the scores
unchanged) and the output sliced back; the padded columns carry exact zeros and get no gradient.

The "kv latent cached in compressed form": there is no inference KV cache here. In training, what is kept
for backward under selective recomputation (train.activation_checkpointing=selective) is the latent: the
checkpointed core is W_kvb + attention, so per token r_kv + d_rope values (576 in V3) are saved instead of
n * (d_nope + d_rope + d_v) (40960 in V3) and the up-projection is recomputed in backward.

Shapes: b batch, s local sequence (s/cp), n/tp heads per TP rank; with SP the block input is (b, s/tp, h).
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel3d.kernels import dispatch
from parallel3d.kernels.rope import rope_inv_freq
from parallel3d.context_parallel import context_parallel_attention
from parallel3d.mesh import ParallelContext
from parallel3d.params import ParamMeta, full_slices, new_param
from parallel3d.tensor_parallel import ColumnParallelLinear, RMSNorm, RowParallelLinear, column_entry, enter_tp_region

LATENT_NORM_EPS = 1e-6
YARN_KEYS = ("rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
             "mscale_all_dim", "attention_factor", "truncate")


def check_mla_config(cfg: Any) -> None:
    """ValueError naming the first MLA field that cannot work."""
    for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"model.attention_type=mla needs model.{name} >= 1, got {getattr(cfg, name)}")
    if cfg.q_lora_rank < 0 or cfg.qk_nope_head_dim < 0:
        raise ValueError("model.q_lora_rank and model.qk_nope_head_dim must be >= 0")
    if cfg.qk_rope_head_dim % 2:
        raise ValueError(f"model.qk_rope_head_dim={cfg.qk_rope_head_dim} must be even for RoPE")
    if cfg.num_kv_heads != cfg.num_heads:
        raise ValueError(f"model.attention_type=mla: every head has its own key and value (decompressed from the "
                         f"latent); set model.num_kv_heads = model.num_heads = {cfg.num_heads}")
    scaling = cfg.rope_scaling
    if scaling:
        if scaling.get("rope_type") != "yarn":
            raise ValueError(f"model.rope_scaling for mla must be YaRN (rope_type: yarn), got {scaling!r}")
        unknown = sorted(set(scaling) - set(YARN_KEYS))
        missing = [k for k in ("factor", "original_max_position_embeddings") if scaling.get(k) is None]
        if unknown or missing:
            raise ValueError(f"model.rope_scaling (yarn): unknown keys {unknown}, missing keys {missing}")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023) inverse frequencies (dim/2,) and the factor that multiplies cos and sin.

    Dimensions rotating fewer than beta_slow times over the original context are interpolated (frequency /
    factor), those rotating more than beta_fast times are kept, with a linear ramp between."""
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    extrapolated = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))  # (dim/2,)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)  # 0: keep, 1: interpolate
    inv_freq = extrapolated * (1 - ramp) + extrapolated / factor * ramp
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                            else yarn_mscale(factor))
    return inv_freq.float(), float(attention_factor)


def mla_rope(cfg: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq (qk_rope_head_dim/2,), cos/sin factor) of the decoupled RoPE."""
    if cfg.rope_scaling:
        return yarn_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    return rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta), 1.0


def mla_softmax_scale(cfg: Any) -> float:
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scaling = cfg.rope_scaling or {}
    if scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(float(scaling["factor"]), scaling["mscale_all_dim"]) ** 2
    return scale


class LatentProjection(nn.Module):
    """A down-projection to a latent, replicated over TP (see the module docstring for its gradient rule)."""

    def __init__(self, in_features: int, out_features: int, ctx: ParallelContext, sp: bool) -> None:
        super().__init__()
        tp = ctx.tp.size
        shape = (out_features, in_features)
        self.weight = new_param(shape, ParamMeta(shape, full_slices(shape), grad_reduce=("tp",) if sp and tp > 1
                                                 else (), replicated=("tp",) if tp > 1 else (), matrix=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class MLAttention(nn.Module):
    """Drop-in for models.llama.Attention: forward(x, cos, sin) with cos/sin of width qk_rope_head_dim."""

    def __init__(self, cfg: Any, ctx: ParallelContext, sp: bool, cp_mode: str, recompute_core: bool) -> None:
        super().__init__()
        tp, h, n = ctx.tp, cfg.hidden_size, cfg.num_heads
        if n % tp.size:
            raise ValueError(f"model.num_heads={n} is not divisible by parallel.tp={tp.size}")
        self.tp, self.sp, self.cp, self.cp_mode, self.backend = tp, sp, ctx.cp, cp_mode, cfg.kernels
        self.recompute_core = recompute_core
        self.r_q, self.r_kv = cfg.q_lora_rank, cfg.kv_lora_rank
        self.d_nope, self.d_rope, self.d_v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        d_qk = self.d_nope + self.d_rope
        self.scale = mla_softmax_scale(cfg)
        self.rope_factor = mla_rope(cfg)[1]
        if self.r_q:
            self.q_a_proj = LatentProjection(h, self.r_q, ctx, sp)
            self.q_a_norm = RMSNorm(self.r_q, LATENT_NORM_EPS, tp, sp, cfg.kernels)
            self.q_b_proj = ColumnParallelLinear(self.r_q, n * d_qk, tp, sp, enter_region=False)
        else:
            self.q_proj = ColumnParallelLinear(h, n * d_qk, tp, sp, enter_region=False)
        self.kv_a_proj = LatentProjection(h, self.r_kv + self.d_rope, ctx, sp)
        self.kv_a_norm = RMSNorm(self.r_kv, LATENT_NORM_EPS, tp, sp, cfg.kernels)
        self.kv_b_proj = ColumnParallelLinear(self.r_kv, n * (self.d_nope + self.d_v), tp, sp, enter_region=False)
        self.o_proj = RowParallelLinear(n * self.d_v, h, tp, sp)

    def _latents(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (b, s[/tp], h) -> c_kv (r_kv), k_r (d_rope), each (b, s, .), entered into the TP region by one
        collective (SP all-gather, or identity forward / all-reduce backward): the core needs the whole
        sequence's latent, and it is what selective recomputation keeps."""
        c_kv, k_r = self.kv_a_proj(x).split([self.r_kv, self.d_rope], -1)  # (b, s[/tp], r_kv), (.., d_rope)
        latent = enter_tp_region(torch.cat([self.kv_a_norm(c_kv), k_r], -1), self.tp, self.sp)  # (b, s, r_kv + d_rope)
        c_kv, k_r = latent.split([self.r_kv, self.d_rope], -1)
        return c_kv, k_r

    def _core(self, q_nope: torch.Tensor, q_rot: torch.Tensor, c_kv: torch.Tensor, k_r: torch.Tensor,
              documents=None) -> torch.Tensor:
        """Decompress k/v from the latent and attend: (b, s, n/tp, d_nope), (.., d_rope), (b, s, r_kv),
        (b, s, 1, d_rope) -> (b, s, n/tp, d_v)."""
        b, s, heads, _ = q_nope.shape
        kv = self.kv_b_proj(c_kv).view(b, s, heads, self.d_nope + self.d_v)  # (b, s, n/tp, d_nope + d_v)
        k_nope, v = kv.split([self.d_nope, self.d_v], -1)
        q = torch.cat([q_nope, q_rot], -1)  # (b, s, n/tp, d_qk)
        k = torch.cat([k_nope, k_r.expand(b, s, heads, self.d_rope)], -1)  # (b, s, n/tp, d_qk)
        width = max(q.shape[-1], self.d_v)  # the CP kernels need one width for q, k and v: zero-pad
        q, k, v = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
        o = context_parallel_attention(q, k, v, self.cp, self.cp_mode, causal=True, backend=self.backend,
                                       scale=self.scale, documents=documents)  # (b, s, n/tp, width)
        return o[..., :self.d_v]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents=None) -> torch.Tensor:
        """documents: packed-document ids (parallel3d.context_parallel.Documents) or None (plain causal)."""
        b = x.shape[0]
        c_kv, k_r = self._latents(x)  # (b, s, r_kv), (b, s, d_rope)
        s = c_kv.shape[1]
        # q enters the TP region through its GEMM: under sp only the (b, s/tp, .) input is kept for backward
        if self.r_q:
            c_q = self.q_a_norm(self.q_a_proj(x))  # (b, s[/tp], r_q)
            q = column_entry(c_q, (self.q_b_proj,), self.tp, self.sp)[0]  # (b, s, n/tp * d_qk)
        else:
            q = column_entry(x, (self.q_proj,), self.tp, self.sp)[0]
        q_nope, q_rot = q.view(b, s, -1, self.d_nope + self.d_rope).split([self.d_nope, self.d_rope], -1)
        if self.rope_factor != 1.0:  # YaRN attention factor (transformers scales cos and sin)
            cos, sin = cos * self.rope_factor, sin * self.rope_factor
        q_rot, k_r = dispatch.rope(q_rot, k_r.view(b, s, 1, self.d_rope), cos, sin, self.backend)
        if self.recompute_core and torch.is_grad_enabled():
            o = checkpoint(self._core, q_nope, q_rot, c_kv, k_r, documents, use_reentrant=False)
        else:
            o = self._core(q_nope, q_rot, c_kv, k_r, documents)  # (b, s, n/tp, d_v)
        return self.o_proj(o.reshape(b, s, -1))  # (b, s, h) or (b, s/tp, h) with sp
