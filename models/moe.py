"""Mixture-of-Experts decoder: the Llama stage with MoE MLPs (parallel3d.expert_parallel.MoELayer).

    Mixtral style    every layer MoE (first_k_dense=0), no shared experts, softmax top-2, normalised
    Qwen3-MoE style  every layer MoE (or the first k dense), many small experts (moe_ffn_hidden_size), softmax
                     top-k renormalised only with router_norm_topk (HF norm_topk_prob), QK-norm attention
    DeepSeek style   first_k_dense dense layers, num_shared_experts always-on experts beside many small
                     ("fine-grained") routed ones (moe_ffn_hidden_size), sigmoid scores, bias balancing;
                     DeepSeek-V3 adds group-limited routing, routed_scaling_factor, the sequence-wise aux
                     loss and Multi-Latent Attention (model.attention_type=mla, models/mla.py)

Parameter names: `layers.{i}.mlp.router.weight` (E, h), `layers.{i}.mlp.experts.{gate,up,down}_proj`
(stacked, global (E, f, h) / (E, h, f)), `layers.{i}.mlp.shared_experts.{gate,up,down}_proj.weight`, and
the buffer `layers.{i}.mlp.router.expert_bias` (E,) (checkpoint state; carries `.meta`).

Loss convention. With labels on the last stage, forward returns
    sum of token losses + sum over this stage's MoE layers of T_l * (aux_coef * aux_l + z_coef * z_l) / n
per rank (T_l tokens routed in the global micro-batch, n = DP x CP ranks; see MoELayer). The trainer sums
over DP x CP and divides by the global target-token count N, so each layer adds coef * aux_l weighted by
T_l / N: the plain coefficient when every position has a target, a token-weighted mean over micro-batches
with gradient accumulation. Summed over layers (Megatron's convention). A stage without the head
returns (hidden, aux) with the same units; the pipeline runtime reports it and back-propagates it scaled
like the loss (AuxObjective).

Telemetry and bias balancing: `moe_load_stats()` once per optimizer step on every rank (a collective over
DP x CP and one host sync for all the stage's layers; the layers keep their statistics on the device)
returns the step's tokens per expert per layer and imbalance (max/mean), applies the DeepSeek-V3 bias
update from the step's global load and resets the counters; `moe_load_stats(step_end=False)` peeks.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import nn

from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import Block, Llama
from parallel3d.models.mtp import MTPModule, future_labels, vocab_embed
from parallel3d import comm
from parallel3d.expert_parallel import MoELayer
from parallel3d.host_sync import read_tensor
from parallel3d.mesh import ParallelContext
from parallel3d.tensor_parallel import VocabParallelEmbedding


AUX_KEYS = ("aux_loss", "z_loss", "seq_aux_loss")  # MoELayer.last_aux names, in the telemetry's order


class MoETransformer(Llama):
    """One pipeline stage (or all) of an MoE decoder; see the module docstring for the conventions."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, layers: Optional[Sequence[int]] = None,
                 pre: bool = True, post: bool = True, sequence_parallel: bool = False, cp_mode: str = "ring",
                 recompute: str = "none", expert_impl: Optional[str] = None, compile_blocks: bool = False) -> None:
        if cfg.num_experts < 1:
            raise ValueError("MoETransformer needs model.num_experts > 0 (use Llama for dense models)")
        self.expert_impl = cfg.expert_impl if expert_impl is None else expert_impl  # model.expert_impl
        super().__init__(cfg, ctx, layers, pre, post, sequence_parallel, cp_mode, recompute, compile_blocks)
        self.mtp = None
        if post and cfg.mtp_depth:  # multi-token prediction (models/mtp.py) on the last stage
            self.mtp = nn.ModuleList([MTPModule(cfg, ctx, self.sp, self.make_block(cfg.num_layers + k, cp_mode,
                                                                                   recompute))
                                      for k in range(cfg.mtp_depth)])
            if not pre and not cfg.tie_embeddings:  # a copy of the input embedding, kept equal like tied ones
                self.mtp_embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.tp, self.sp)
                self.mtp_embed.weight.meta.tied_to = "embed.weight"
        if cfg.mtp_depth and not cfg.tie_embeddings and ctx.spec.pp > 1:
            for p in [m.weight for m in (getattr(self, "embed", None), getattr(self, "mtp_embed", None)) if m]:
                p.meta.grad_reduce += ("embedding",)
                p.meta.replicated += ("embedding",)

    def make_block(self, index: int, cp_mode: str, recompute: str) -> Block:
        cfg = self.cfg
        if index < cfg.first_k_dense:
            return Block(cfg, self.ctx, self.sp, cp_mode, recompute)
        ffn = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        mlp = MoELayer(cfg.hidden_size, ffn, cfg.num_experts, cfg.moe_top_k, self.ctx, self.sp,
                       shared_ffn_hidden=cfg.num_shared_experts * ffn, score=cfg.router_score,
                       norm_topk=cfg.router_norm_topk, aux_loss_coef=cfg.aux_loss_coef, z_loss_coef=cfg.z_loss_coef,
                       bias_update_rate=cfg.router_bias_update_rate, capacity_factor=cfg.capacity_factor,
                       impl=self.expert_impl, backend=cfg.kernels, num_groups=cfg.router_num_groups,
                       topk_groups=cfg.router_topk_groups, routed_scaling_factor=cfg.routed_scaling_factor,
                       seq_aux_loss_coef=cfg.seq_aux_loss_coef, aux_scope=cfg.moe_aux_scope,
                       delay_wgrad=cfg.moe_delay_wgrad)
        return Block(cfg, self.ctx, self.sp, cp_mode, recompute, mlp=mlp)

    def moe_layers(self) -> dict[int, MoELayer]:
        """Global layer index -> MoE layer, for the layers of this stage (MTP module k: num_layers + k)."""
        out = {int(i): blk.mlp for i, blk in self.layers.items() if isinstance(blk.mlp, MoELayer)}
        for k, module in enumerate(self.mtp or []):
            if isinstance(module.block.mlp, MoELayer):
                out[self.cfg.num_layers + k] = module.block.mlp
        return out

    def _mtp_loss(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor,
                  labels: torch.Tensor, documents=None) -> torch.Tensor:
        """lambda / D * sum_k (summed CE of predicting t_{i+k+1}); see models/mtp.py."""
        if self.pre or self.cfg.tie_embeddings:
            table = self.embed.weight if self.pre else self.lm_head.weight
            start, real = self.vocab_start, self.vocab_real
        else:
            table, start, real = self.mtp_embed.weight, self.mtp_embed.start, self.mtp_embed.real_rows
        total = hidden.new_zeros((), dtype=torch.float32)
        for k, module in enumerate(self.mtp, start=1):
            inputs = future_labels(labels, k - 1, self.ctx.cp).clamp(min=0)  # t_{i+k}; ignored slots -> id 0
            emb = vocab_embed(inputs, table, start, real, self.ctx.tp, self.sp)  # (b, s[/tp], h)
            hidden, normed = module(hidden, emb, cos, sin, position_ids, documents)
            total = total + self.output(normed, future_labels(labels, k, self.ctx.cp), normed=True)
        return total * (self.cfg.mtp_loss_coef / len(self.mtp))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, labels: Optional[torch.Tensor] = None,
                documents=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As Llama.forward. The stage's MoE balancing terms join the loss on the stage with the head; a
        stage without it returns (hidden, aux) while training, for the pipeline runtime to report and
        back-propagate (parallel3d.pipeline.stage.PipelineStage)."""
        layers = self.moe_layers()
        if self.mtp is not None and labels is not None and torch.is_grad_enabled():
            hidden, cos, sin = self.trunk(x, position_ids, documents)
            out = self.output(hidden, labels) + self._mtp_loss(hidden, cos, sin, position_ids, labels, documents)
        else:
            out = super().forward(x, position_ids, labels, documents)
        terms = [t for t in (layer.pop_aux_loss() for layer in layers.values()) if t is not None]
        if not terms:
            return out
        aux = torch.stack(terms).sum()
        if self.post:
            return out + aux if labels is not None else out
        return out, aux

    # ---- telemetry ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _global_stats(self) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """Per MoE layer: the step's load (2, E) summed over DP x CP on the device, and the same load with the
        last micro-batch's auxiliary values (mean over DP x CP) on the host: one all-reduce and one host
        sync for all of this stage's layers (host-sync category "logging")."""
        layers = self.moe_layers()
        if not layers:
            return {}, {}
        aux = [torch.stack([layer.last_aux.get(k, torch.zeros((), device=self.ctx.device)).double()
                            for k in AUX_KEYS]) for layer in layers.values()]  # (3,) each
        local = torch.stack([torch.cat([layer.local_load().flatten(), a.to(self.ctx.device)])
                             for layer, a in zip(layers.values(), aux)])  # (L, 2E + 3) float64
        glob = comm.all_reduce(local, self.ctx.dp_cp)
        host = read_tensor(glob, self.ctx.stats.syncs, "logging")  # (L, 2E + 3)
        e = self.cfg.num_experts
        device = {i: glob[j, :2 * e].view(2, e) for j, i in enumerate(layers)}
        return device, {i: host[j] for j, i in enumerate(layers)}

    def moe_load_stats(self, step_end: bool = True) -> dict[str, Any]:
        """Global expert load of this stage's MoE layers since the last step end, as flat JSON-ready keys
        (layer = global layer index, so stages and virtual chunks never collide):

            moe_tokens_per_expert.{layer}   [E ints] routed slots per expert (before capacity drops)
            moe_dropped_per_expert.{layer}  [E ints] of which dropped (only with a capacity factor)
            moe_imbalance.{layer}           max / mean load (1.0 is perfect balance)
            moe_aux_loss.{layer}, moe_z_loss.{layer}, moe_seq_aux_loss.{layer}   last micro-batch's values
                                            (when enabled; mean over DP x CP: the global value under
                                            model.moe_aux_scope=global, the ranks' mean under local)
            moe_imbalance_max, moe_imbalance_mean, moe_drop_fraction   over this stage's layers

        step_end=True (call exactly once per optimizer step, on every rank): also applies the DeepSeek-V3
        bias update from the step's global load (on the device) and resets the counters. step_end=False
        only peeks. A collective over DP x CP and one host sync, whatever the number of layers.
        """
        loads, host = self._global_stats()
        if not loads:
            return {}
        layers = self.moe_layers()
        e, ranks = self.cfg.num_experts, self.ctx.dp_cp.size
        out: dict[str, Any] = {}
        imbalance, routed_all, dropped_all = [], 0.0, 0.0
        for i, row in host.items():
            routed, dropped = row[:e], row[e:2 * e]
            imbalance.append(float(routed.max() / routed.mean()) if routed.sum() > 0 else 1.0)
            routed_all, dropped_all = routed_all + float(routed.sum()), dropped_all + float(dropped.sum())
            out[f"moe_tokens_per_expert.{i}"] = [int(v) for v in routed.tolist()]
            out[f"moe_imbalance.{i}"] = imbalance[-1]
            if layers[i].capacity_factor > 0:
                out[f"moe_dropped_per_expert.{i}"] = [int(v) for v in dropped.tolist()]
            for k, key in enumerate(AUX_KEYS):
                if key in layers[i].last_aux:
                    out[f"moe_{key}.{i}"] = float(row[2 * e + k]) / ranks
        out.update(moe_imbalance_max=max(imbalance), moe_imbalance_mean=sum(imbalance) / len(imbalance),
                   moe_drop_fraction=dropped_all / routed_all if routed_all else 0.0)
        if step_end:
            for i, layer in layers.items():
                layer.update_bias(loads[i][0])
                layer.reset_load()
        return out
