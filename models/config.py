"""Typed model configuration shared by the Llama and MoE transformers."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from parallel3d.kernels.attention_backend import ATTENTION_BACKENDS
from parallel3d.expert_parallel.experts import IMPLS as EXPERT_IMPLS
from parallel3d.expert_parallel.layer import AUX_SCOPES
from parallel3d.expert_parallel.router import SCORES as ROUTER_SCORES
from parallel3d.kernels.dispatch import BACKENDS as KERNEL_BACKENDS

# model.fused_head_form: the fused head's loss form (models/llama.py Llama.fused_loss); auto is resolved by the
# training side from the pipeline schedule (pipeline/head_form.py, in training/validate.resolve_and_validate)
FUSED_HEAD_FORMS = ("auto", "summed", "per_token")

# Model keys with a closed set of values -> that set, from its owner; ModelConfig.validate checks against
# these and docs/configuration.md lists them (launch/config_doc.py).
CHOICES: dict[str, tuple] = {
    "kernels": KERNEL_BACKENDS,
    "expert_impl": EXPERT_IMPLS,
    "attention": ATTENTION_BACKENDS,
    "router_score": ROUTER_SCORES,
    "attention_type": ("mha", "mla"),
    "moe_aux_scope": AUX_SCOPES,
    "fused_head_form": FUSED_HEAD_FORMS,
}


@dataclass
class ModelConfig:
    vocab_size: int = 256        # tokens in the vocabulary (embedding and output rows)
    hidden_size: int = 64        # width of the residual stream
    num_layers: int = 2          # transformer blocks
    num_heads: int = 4           # attention (query) heads
    num_kv_heads: int = 2              # grouped-query attention: num_heads % num_kv_heads == 0
    head_dim: int = 0                  # width of one attention head; 0: hidden_size // num_heads (Qwen3: 128)
    ffn_hidden_size: int = 172   # inner width of the SwiGLU MLP
    rope_theta: float = 10000.0  # RoPE base frequency
    rope_scaling: Optional[dict] = None  # Llama-3: factor, low/high_freq_factor, original_max_position_embeddings
    norm_eps: float = 1e-5       # RMSNorm epsilon
    max_seq_len: int = 256       # longest sequence the RoPE tables cover
    tie_embeddings: bool = False  # the output head shares the input embedding's weight
    init_std: float = 0.02       # standard deviation of the normal initial weights
    qk_norm: bool = False              # Qwen3: RMSNorm over each query and key head (weight (head_dim,)) before RoPE
    qkv_bias: bool = False             # Qwen2/2.5: biases on the q, k and v projections (not on o)
    kernels: str = "auto"        # fused kernels: triton, the torch reference, or auto (triton where it runs)
    fused_head: bool = True            # loss by the chunked fused linear + CE: no full logits in training
    fused_head_form: str = "auto"      # summed: grads held fwd to bwd; per_token: logits recomputed; auto: by schedule
    expert_impl: str = "auto"    # how the routed experts' GEMMs run (auto picks per device)
    attention: str = "auto"      # attention backend (flash_attn needs its package; flex trains on CUDA only; auto picks per device)
    # Mixture-of-Experts (num_experts == 0 means dense). Filled in by the MoE issue.
    num_experts: int = 0         # routed experts per MoE layer; 0: a dense model
    moe_top_k: int = 2           # experts each token is routed to
    moe_ffn_hidden_size: int = 0  # inner width of each expert's MLP; 0: ffn_hidden_size
    num_shared_experts: int = 0  # experts every token goes through besides its routed ones
    first_k_dense: int = 0             # DeepSeek-style: the first k layers keep a dense MLP
    router_score: str = "softmax"  # router scores: softmax over experts, or a sigmoid per expert (DeepSeek-V3)
    router_norm_topk: bool = True  # renormalise the chosen experts' weights to sum to 1
    aux_loss_coef: float = 0.0   # coefficient of the load-balancing auxiliary loss
    z_loss_coef: float = 0.0     # coefficient of the router z-loss (keeps router logits small)
    router_bias_update_rate: float = 0.0   # >0: DeepSeek-V3 auxiliary-loss-free balancing
    capacity_factor: float = 0.0       # 0: drop-less
    moe_delay_wgrad: bool = False      # experts' weight gradients beside the dispatch's backward all-to-all (ep > 1, etp = 1)
    # DeepSeek-V3 routing (parallel3d.expert_parallel.router): group-limited top-k, scaled combine weights
    router_num_groups: int = 1         # experts split into this many groups (HF n_group); 1: no group limit
    router_topk_groups: int = 1        # tokens pick experts only inside their best groups (HF topk_group)
    routed_scaling_factor: float = 1.0  # routed experts' combine weights are multiplied by this
    seq_aux_loss_coef: float = 0.0     # DeepSeek-V3 sequence-wise balance loss coefficient (alpha)
    moe_aux_scope: str = "global"      # global: balancing statistics all-reduced over DP x CP in forward;
                                       # local: this rank's tokens, no collective (expert_parallel/layer.py)
    # Attention: mha (multi/grouped-query, models/llama.py) | mla (DeepSeek Multi-Latent, models/mla.py)
    attention_type: str = "mha"  # mha: multi/grouped-query (models/llama.py); mla: DeepSeek Multi-Latent (models/mla.py)
    q_lora_rank: int = 0               # mla: query latent rank (0: plain q projection)
    kv_lora_rank: int = 0              # mla: key/value latent rank
    qk_nope_head_dim: int = 0          # mla: per-head query/key dims without RoPE
    qk_rope_head_dim: int = 0          # mla: decoupled RoPE dims (one key shared by all heads)
    v_head_dim: int = 0                # mla: per-head value dims
    mtp_depth: int = 0                 # DeepSeek-V3 multi-token prediction modules (models/mtp.py); 0: none
    mtp_loss_coef: float = 0.3         # lambda: the MTP losses add lambda / mtp_depth * each depth's loss
    extra: dict = field(default_factory=dict)  # free-form settings for custom models (ignored by the built-in ones)

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
        for key, choices in CHOICES.items():
            if getattr(self, key) not in choices:
                raise ValueError(f"model.{key} must be one of {', '.join(choices)}, got {getattr(self, key)!r}")
        if self.num_experts and not 1 <= self.moe_top_k <= self.num_experts:
            raise ValueError(f"model.moe_top_k={self.moe_top_k} must be in [1, num_experts="
                             f"{self.num_experts}]")
        if self.num_experts:
            from parallel3d.expert_parallel.router import check_group_limits
            check_group_limits(self.num_experts, self.moe_top_k, self.router_num_groups, self.router_topk_groups)
        if self.mtp_depth < 0 or (self.mtp_depth and not self.num_experts):
            raise ValueError(f"model.mtp_depth={self.mtp_depth}: multi-token prediction is built for the MoE "
                             f"transformer (model.num_experts > 0), depth >= 0")
        if self.attention_type == "mla":
            from parallel3d.models.mla import check_mla_config
            check_mla_config(self)
