"""Typed model configuration shared by the Llama and MoE transformers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from parallel3d.kernels.attention_backend import ATTENTION_BACKENDS
from parallel3d.expert_parallel.experts import IMPLS as EXPERT_IMPLS


@dataclass
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2              # grouped-query attention: num_heads % num_kv_heads == 0
    head_dim: int = 0                  # width of one attention head; 0: hidden_size // num_heads (Qwen3: 128)
    ffn_hidden_size: int = 172
    rope_theta: float = 10000.0
    rope_scaling: Optional[dict] = None  # Llama-3: factor, low/high_freq_factor, original_max_position_embeddings
    norm_eps: float = 1e-5
    max_seq_len: int = 256
    tie_embeddings: bool = False
    init_std: float = 0.02
    qk_norm: bool = False              # Qwen3: RMSNorm over each query and key head (weight (head_dim,)) before RoPE
    qkv_bias: bool = False             # Qwen2/2.5: biases on the q, k and v projections (not on o)
    kernels: str = "auto"              # auto | triton | torch (DESIGN.md section 3: model.kernels)
    fused_head: bool = True            # loss by the chunked fused linear + CE: no full logits in training
    expert_impl: str = "auto"          # auto | loop | padded | grouped_mm | triton (routed experts' GEMMs)
    attention: str = "auto"            # auto | triton | sdpa | flash_attn (attention backend)
    # Mixture-of-Experts (num_experts == 0 means dense). Filled in by the MoE issue.
    num_experts: int = 0
    moe_top_k: int = 2
    moe_ffn_hidden_size: int = 0       # 0: ffn_hidden_size
    num_shared_experts: int = 0
    first_k_dense: int = 0             # DeepSeek-style: the first k layers keep a dense MLP
    router_score: str = "softmax"      # softmax | sigmoid
    router_norm_topk: bool = True
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    router_bias_update_rate: float = 0.0   # >0: DeepSeek-V3 auxiliary-loss-free balancing
    capacity_factor: float = 0.0       # 0: drop-less
    # DeepSeek-V3 routing (parallel3d.expert_parallel.router): group-limited top-k, scaled combine weights
    router_num_groups: int = 1         # experts split into this many groups (HF n_group); 1: no group limit
    router_topk_groups: int = 1        # tokens pick experts only inside their best groups (HF topk_group)
    routed_scaling_factor: float = 1.0  # routed experts' combine weights are multiplied by this
    seq_aux_loss_coef: float = 0.0     # DeepSeek-V3 sequence-wise balance loss coefficient (alpha)
    moe_aux_scope: str = "global"      # global: balancing statistics all-reduced over DP x CP in forward;
                                       # local: this rank's tokens, no collective (expert_parallel/layer.py)
    # Attention: mha (multi/grouped-query, models/llama.py) | mla (DeepSeek Multi-Latent, models/mla.py)
    attention_type: str = "mha"
    q_lora_rank: int = 0               # mla: query latent rank (0: plain q projection)
    kv_lora_rank: int = 0              # mla: key/value latent rank
    qk_nope_head_dim: int = 0          # mla: per-head query/key dims without RoPE
    qk_rope_head_dim: int = 0          # mla: decoupled RoPE dims (one key shared by all heads)
    v_head_dim: int = 0                # mla: per-head value dims
    mtp_depth: int = 0                 # DeepSeek-V3 multi-token prediction modules (models/mtp.py); 0: none
    mtp_loss_coef: float = 0.3         # lambda: the MTP losses add lambda / mtp_depth * each depth's loss
    extra: dict = field(default_factory=dict)

    @property
    def attn_head_dim(self) -> int:
        """The per-head width the attention uses: model.head_dim, or hidden_size // num_heads when 0."""
        return self.head_dim or self.hidden_size // self.num_heads

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        if self.head_dim < 0:
            raise ValueError(f"model.head_dim={self.head_dim} must be >= 0 (0: hidden_size // num_heads)")
        if not self.head_dim and self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} is not divisible by "
                             f"model.num_kv_heads={self.num_kv_heads}")
        if self.attn_head_dim % 2:
            raise ValueError(f"model.head_dim={self.attn_head_dim} must be even for RoPE")
        if self.kernels not in ("auto", "triton", "torch"):
            raise ValueError(f"model.kernels must be auto, triton or torch, got {self.kernels!r}")
        for key, value, choices in (("expert_impl", self.expert_impl, EXPERT_IMPLS),
                                    ("attention", self.attention, ATTENTION_BACKENDS)):
            if value not in choices:
                raise ValueError(f"model.{key} must be one of {', '.join(choices)}, got {value!r}")
        if self.num_experts and not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(f"model.moe_top_k={self.moe_top_k} must be in [1, num_experts="
                             f"{self.num_experts}]")
        if self.router_score not in ("softmax", "sigmoid"):
            raise ValueError(f"model.router_score must be softmax or sigmoid, got {self.router_score!r}")
        from parallel3d.expert_parallel.layer import check_aux_scope
        check_aux_scope(self.moe_aux_scope)
        if self.num_experts:
            from parallel3d.expert_parallel.router import check_group_limits
            check_group_limits(self.num_experts, self.moe_top_k, self.router_num_groups, self.router_topk_groups)
        if self.mtp_depth < 0 or (self.mtp_depth and not self.num_experts):
            raise ValueError(f"model.mtp_depth={self.mtp_depth}: multi-token prediction is built for the MoE "
                             f"transformer (model.num_experts > 0), depth >= 0")
        if self.attention_type not in ("mha", "mla"):
            raise ValueError(f"model.attention_type must be mha or mla, got {self.attention_type!r}")
        if self.attention_type == "mla":
            from parallel3d.models.mla import check_mla_config
            check_mla_config(self)
