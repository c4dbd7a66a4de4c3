"""Llama decoder built from parallel3d layers. With a world-size-1 context it is plain PyTorch.

A `Llama` instance is one pipeline stage (or the whole model): it holds the layers whose global indices
it is given, plus the embedding (`pre`) and/or final norm + LM head + loss (`post`). Parameter names use
global layer indices (`layers.7.attn.q_proj.weight`), so names, initial values and checkpoints are the
same under every layout.

Shapes: b batch, s local sequence (s/cp under context parallelism), h hidden, tp the TP size; with
sequence parallelism the residual stream is (b, s/tp, h).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn

from parallel3d.kernels import dispatch
from parallel3d.kernels.attention_backend import attention_setting
from parallel3d.kernels.rope import rope_cos_sin, rope_inv_freq
from parallel3d.models.config import ModelConfig
from parallel3d.models.mla import MLAttention, mla_rope
from parallel3d import comm
from parallel3d.context_parallel import context_parallel_attention
from parallel3d.mesh import ParallelContext
from parallel3d.params import init_parameters
from parallel3d.tensor_parallel import (ColumnParallelLinear, KVParallelLinear, RMSNorm, RowParallelLinear,
                                        VocabParallelEmbedding, column_entry, enter_tp_region, gather_from_tp,
                                        vocab_parallel_cross_entropy)
from parallel3d.tensor_parallel.cross_entropy import IGNORE_INDEX
from parallel3d.tensor_parallel.layers import vocab_shard



class Attention(nn.Module):
    """Megatron attention block: q/k/v column-parallel (heads split over TP), o_proj row-parallel.

    Qwen options: `qkv_bias` adds biases to q/k/v (Qwen2); `qk_norm` applies an RMSNorm over each query
    and key head (one (head_dim,) weight each, shared by all heads) before RoPE (Qwen3). Under TP each rank
    normalises its own heads, no gather; its norm-weight gradient covers only those heads, so it is
    partial and summed over TP (the same reduction as a sequence-parallel norm).
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, sp: bool, cp_mode: str, recompute_core: bool) -> None:
        super().__init__()
        tp, h, d = ctx.tp, cfg.hidden_size, cfg.attn_head_dim
        if cfg.num_heads % tp.size:
            raise ValueError(f"model.num_heads={cfg.num_heads} is not divisible by parallel.tp={tp.size}")
        self.tp, self.sp, self.cp, self.cp_mode, self.backend = tp, sp, ctx.cp, cp_mode, cfg.kernels
        self.recompute_core = recompute_core
        self.attention = attention_setting(cfg.attention, cfg.kernels)  # model.attention (auto: by model.kernels)
        bias = cfg.qkv_bias
        self.q_proj = ColumnParallelLinear(h, cfg.num_heads * d, tp, sp, enter_region=False, bias=bias)
        self.k_proj = KVParallelLinear(h, cfg.num_kv_heads, d, tp, bias=bias)
        self.v_proj = KVParallelLinear(h, cfg.num_kv_heads, d, tp, bias=bias)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, h, tp, sp)
        self.head_dim = d
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:  # sequence_parallel=True: the partial-over-TP gradient reduction (see class docstring)
            self.q_norm = RMSNorm(d, cfg.norm_eps, tp, sequence_parallel=True, backend=cfg.kernels)
            self.k_norm = RMSNorm(d, cfg.norm_eps, tp, sequence_parallel=True, backend=cfg.kernels)

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents=None) -> torch.Tensor:
        return context_parallel_attention(q, k, v, self.cp, self.cp_mode, causal=True, backend=self.attention,
                                          documents=documents)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, documents=None) -> torch.Tensor:
        """documents: packed-document ids (parallel3d.context_parallel.Documents) or None (plain causal)."""
        # enter the TP region and project; under sp only the (b, s/tp, h) shard is kept for backward
        q, k, v = column_entry(x, (self.q_proj, self.k_proj, self.v_proj), self.tp, self.sp)
        b, s = q.shape[:2]
        q = q.view(b, s, -1, self.head_dim)  # (b, s, nh/tp, d)
        k = k.view(b, s, -1, self.head_dim)  # (b, s, nkv/tp or 1, d)
        v = v.view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # per head: normalised over d, before RoPE
        q, k = dispatch.rope(q, k, cos, sin, self.backend)
        if self.recompute_core and torch.is_grad_enabled():
            o = checkpoint(self._core, q, k, v, documents, use_reentrant=False)
        else:
            o = self._core(q, k, v, documents)  # (b, s, nh/tp, d)
        return self.o_proj(o.reshape(b, s, -1))  # (b, s, h) or (b, s/tp, h) with sp


class MLP(nn.Module):
    """SwiGLU MLP: gate and up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, sp: bool, ffn_hidden: Optional[int] = None) -> None:
        super().__init__()
        h, f = cfg.hidden_size, ffn_hidden or cfg.ffn_hidden_size
        self.tp, self.sp, self.backend = ctx.tp, sp, cfg.kernels
        self.gate_proj = ColumnParallelLinear(h, f, ctx.tp, sp, enter_region=False)
        self.up_proj = ColumnParallelLinear(h, f, ctx.tp, sp, enter_region=False)
        self.down_proj = RowParallelLinear(f, h, ctx.tp, sp)

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        gate, up = column_entry(x, (self.gate_proj, self.up_proj), self.tp, self.sp)  # (b, s, f/tp) each
        return self.down_proj(dispatch.swiglu(gate, up, self.backend))  # (b, s, h) or (b, s/tp, h) with sp


class Block(nn.Module):
    """Pre-norm attention + MLP. `mlp` (default: SwiGLU) is called as mlp(x, position_ids)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, sp: bool, cp_mode: str, recompute: str,
                 mlp: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.tp, sp, cfg.kernels)
        attention = MLAttention if cfg.attention_type == "mla" else Attention  # model.attention_type
        self.attn = attention(cfg, ctx, sp, cp_mode, recompute_core=recompute == "selective")
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, ctx.tp, sp, cfg.kernels)
        self.mlp = mlp if mlp is not None else MLP(cfg, ctx, sp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                position_ids: Optional[torch.Tensor] = None, documents=None) -> torch.Tensor:
        h = self.attn(self.attn_norm(x), cos, sin, documents)  # (b, s, h) or (b, s/tp, h) with sp
        normed, x = self.mlp_norm.add_and_norm(h, x)  # fused: x <- x + h, normed = rmsnorm(x)
        return x + self.mlp(normed, position_ids)


class Llama(nn.Module):
    """One pipeline stage (or all) of a Llama decoder.

    forward(x, position_ids, labels=None):
      x: token ids (b, s) on the stage with `pre`, else the previous stage's hidden states.
      position_ids: (s,) positions of this rank's tokens (context parallelism gives non-contiguous ones),
      or (b, s) per row (positions restarting at each packed document).
      documents: packed-document ids of the whole sequence (parallel3d.context_parallel.Documents) for
      document-masked attention, or None.
      returns: the summed token loss (fp32 scalar) when `post` and labels are given (ignore_index=-100
      targets excluded; the trainer divides by the global token count); full-vocabulary logits (b, s, V)
      when `post` without labels; otherwise the hidden states for the next stage.
    """

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layers: Optional[Sequence[int]] = None,
                 pre: bool = True, post: bool = True, sequence_parallel: bool = False, cp_mode: str = "ring",
                 recompute: str = "none", compile_blocks: bool = False) -> None:
        super().__init__()
        cfg.validate()
        if recompute not in ("none", "full", "selective"):
            raise ValueError(f"activation checkpointing must be none, full or selective, got {recompute!r}")
        self.cfg, self.ctx, self.pre, self.post = cfg, ctx, pre, post
        self.sp = sequence_parallel and ctx.tp.size > 1
        self.recompute = recompute
        self.recompute_layers = 0  # train.recompute_layers (set_recompute_layers)
        tp = ctx.tp
        layer_ids = list(range(cfg.num_layers)) if layers is None else list(layers)
        if pre:
            self.embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, self.sp)
        self.layers = nn.ModuleDict({str(i): self.make_block(i, cp_mode, recompute) for i in layer_ids})
        if compile_blocks:  # train.compile: each block in place (names, PP stages and checkpointing unchanged)
            for block in self.layers.values():
                block.compile()
        if post:
            self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, tp, self.sp, cfg.kernels)
            self.vocab_start, self.vocab_real, _ = vocab_shard(cfg.vocab_size, tp.size, tp.rank)
            if not (cfg.tie_embeddings and pre):
                self.lm_head = ColumnParallelLinear(cfg.hidden_size, cfg.vocab_size, tp, self.sp,
                                                    enter_region=False, vocab_padding=True)
                if cfg.tie_embeddings:  # tied across pipeline stages: same init, grads summed over the
                    self.lm_head.weight.meta.tied_to = "embed.weight"   # embedding group (first+last stage)
        if cfg.tie_embeddings and ctx.spec.pp > 1:
            for p in self._tied_params():
                p.meta.grad_reduce += ("embedding",)
                p.meta.replicated += ("embedding",)
        inv_freq = (mla_rope(cfg)[0] if cfg.attention_type == "mla"
                    else rope_inv_freq(cfg.attn_head_dim, cfg.rope_theta, cfg.rope_scaling))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def boundary_shape(self, batch: int, seq_local: int) -> tuple[int, int, int]:
        """The residual stream between pipeline stages (parallel3d.pipeline.stage.PipelineStage)."""
        return batch, seq_local // self.ctx.tp.size if self.sp else seq_local, self.cfg.hidden_size  # (b, s, h)

    def set_recompute_layers(self, n: int) -> None:
        """train.recompute_layers: the first n blocks of this chunk are recomputed whole in backward (all of
        them when n exceeds the chunk's blocks), the others follow `recompute`. A whole-recomputed block
        does not also checkpoint its attention core (selective) inside."""
        self.recompute_layers = n
        for i, block in enumerate(self.layers.values()):
            attn = getattr(block, "attn", None)
            if attn is not None and hasattr(attn, "recompute_core"):
                attn.recompute_core = self.recompute == "selective" and i >= n

    def make_block(self, index: int, cp_mode: str, recompute: str) -> nn.Module:
        """Override to build a different block per layer (the MoE model does)."""
        return Block(self.cfg, self.ctx, self.sp, cp_mode, recompute)

    def _tied_params(self) -> list[nn.Parameter]:
        out = []
        if self.pre:
            out.append(self.embed.weight)
        if self.post and hasattr(self, "lm_head"):
            out.append(self.lm_head.weight)
        return out

    def init_weights(self, seed: int) -> None:
        init_parameters(self, seed, self.cfg.init_std)

    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight if hasattr(self, "lm_head") else self.embed.weight

    def fused_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Summed token loss of the LM head without the (b*s, V/tp) logits: the fused linear + CE takes the
        tokens in chunks (kernels.fused_linear_cross_entropy), in the form model.fused_head_form names:
        summed (reduction="sum": each chunk's gradients formed in the forward while its logits are live and
        held until the backward, which only scales them) or per_token (reduction="none", then summed: only
        the per-token lse is held; the backward recomputes each chunk's logits). The training side resolves
        auto from the schedule (pipeline/head_form.py); a model run on its own from an unresolved config
        runs one forward, then its backward, so it takes summed.
        Under TP each rank holds a vocabulary shard; the per-token max / sum-exp / target logit are combined
        over the TP group inside it, and d x is this rank's partial sum, all-reduced by enter_tp_region's
        backward exactly as for the unfused head."""
        tp = self.ctx.tp
        weight = self.head_weight()  # (V/tp, h) incl. padding rows, which take no part in the loss:
        if self.vocab_real < weight.shape[0]:
            weight = weight[: self.vocab_real]  # (V_real/tp, h)
        reduce_max = reduce_sum = None
        if tp.size > 1:
            reduce_max, reduce_sum = (lambda t: comm.all_reduce(t, tp, op="max")), (lambda t: comm.all_reduce(t, tp))
        per_token = self.cfg.fused_head_form == "per_token"
        loss = dispatch.fused_linear_cross_entropy(x.flatten(0, 1), weight, labels.flatten(), IGNORE_INDEX,
                                                   backend=self.cfg.kernels, vocab_start=self.vocab_start,
                                                   all_reduce_max=reduce_max, all_reduce_sum=reduce_sum,
                                                   reduction="none" if per_token else "sum")  # (b*s,) or ()
        return loss.sum() if per_token else loss  # () summed over the b*s tokens

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                documents=None) -> torch.Tensor:
        x, _, _ = self.trunk(x, position_ids, documents)
        return self.output(x, labels) if self.post else x

    def trunk(self, x: torch.Tensor, position_ids: torch.Tensor, documents=None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Embedding (first stage) and this stage's blocks -> (hidden states, rope cos, rope sin)."""
        cos, sin = rope_cos_sin(position_ids.to(x.device), self.inv_freq)  # (s, d) or (b, s, d)
        extra = {} if documents is None else {"documents": documents}  # custom blocks may not take it
        if self.pre:
            x = self.embed(x)  # (b, s, h) or (b, s/tp, h)
        for i, block in enumerate(self.layers.values()):
            if (self.recompute == "full" or i < self.recompute_layers) and torch.is_grad_enabled():
                replay = getattr(getattr(block, "mlp", None), "recompute_contexts", noop_context_fn)  # MoE splits
                x = checkpoint(block, x, cos, sin, position_ids, use_reentrant=False, context_fn=replay, **extra)
            else:
                x = block(x, cos, sin, position_ids, **extra)
        return x, cos, sin

    def output(self, x: torch.Tensor, labels: Optional[torch.Tensor] = None, normed: bool = False) -> torch.Tensor:
        """Final norm (unless `normed`) and LM head: full logits, or the summed token loss."""
        x = enter_tp_region(x if normed else self.norm(x), self.ctx.tp, self.sp)  # (b, s, h)
        if labels is not None and self.cfg.fused_head:
            return self.fused_loss(x, labels)
        logits = torch.nn.functional.linear(x, self.head_weight())  # (b, s, V/tp) incl. padding
        if labels is None:
            full = gather_from_tp(logits, self.ctx.tp, -1)  # (b, s, V_padded)
            return full[..., : self.cfg.vocab_size]
        losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), labels.flatten(), self.ctx.tp, self.vocab_start,
                                              self.vocab_real, IGNORE_INDEX, self.cfg.kernels)  # (b*s,)
        return losses.sum()
