"""The MoE layer: router -> (capacity) -> permute -> all-to-all -> grouped experts -> all-to-all -> combine,
plus always-on shared experts, auxiliary losses and load telemetry.

Tensor parallelism: the shared experts follow the dense MLP's TP; the routed experts are split over the etp
group (expert tensor parallelism, `parallel.etp`), EP and etp folded over the stage's TP x CP x DP ranks
(mesh_spec.py). Three orders:
  SP (tp > 1)          each TP rank routes and dispatches only its own (b, s/tp) tokens; with etp > 1 the
                       experts gather the rows of all etp ranks and reduce-scatter their outputs back
                       (sp_dispatch.py), so the layer keeps 1/tp of its activations
  no SP, etp == tp     (the layout before folding) one TP region like the dense MLP: every TP rank routes the
                       same tokens, runs its ffn slice of every local expert on them (EP groups share the TP
                       rank), and one all-reduce sums the partial outputs
  no SP, etp != tp     every TP rank routes the same tokens but dispatches only its 1/tp share of them
                       (sp_dispatch.split_forward); the same one all-reduce assembles the rows

Auxiliary losses (Switch load balancing, router z-loss, DeepSeek-V3's sequence-wise balance loss) come from
balancing statistics (per-expert counts, probability sums, squared log-partition sums, the token count) whose
scope is `model.moe_aux_scope`:
  global (default)  all-reduced over DP x CP in forward (every rank of a stage holding different tokens; EP
                    is a subset), so every layout gets the world-size-1 value of the same global micro-batch
                    (the sequence-wise loss sums each sequence over CP first, see MoELayer._sequence_aux). The
                    all-reduce passes gradients through unchanged (each rank back-propagates the global loss
                    through its own tokens; the DP gradient sum completes it). One blocking collective per
                    MoE layer forward.
  local             this rank's tokens only (Megatron's and DeepSeek's "local" balancing): no collective in
                    forward; each rank's loss is that of its own tokens, and the trainer's sum over DP x CP
                    makes the token-weighted mean of the ranks' losses.

`pop_aux_loss()` returns this layer's term in *summed-loss units*. Global: its value is T * A / n_dpcp per
rank (T = tokens routed in the global micro-batch, A = aux_coef * aux + z_coef * z, n_dpcp ranks), so summing
over DP x CP and dividing by the global target-token count, as the trainer does with the summed token loss,
adds A with weight T / N_tokens, i.e. exactly the coefficient when every position has a target. Local: its
value is T_r * A_r (this rank's tokens and loss). The gradient is scaled 1/tp because every TP rank
back-propagates the same replicated term.

Telemetry stays on the device: the routed (and dropped) slots per expert accumulate in device tensors and the
last micro-batch's auxiliary values are kept as device scalars; the model reads them once per step at log
time (models/moe.py, moe_load_stats), so the forward (and its recomputation) never waits for the device.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from parallel3d.kernels import dispatch as kernels
from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.expert_parallel.delayed_wgrad import check_delay_wgrad, dispatched_experts
from parallel3d.expert_parallel.dispatch import ExpertExchange, SplitTape, Taping, kept_counts, permute, unpermute
from parallel3d.expert_parallel.experts import GroupedExperts
from parallel3d.expert_parallel.router import (Router, Routing, balance_probs, expert_capacity, expert_counts,
                                               sequence_balance_loss, sequence_balance_stats,
                                               sharded_capacity_keep_mask, switch_aux_loss, update_expert_bias,
                                               z_loss_sum)
from parallel3d.expert_parallel.sp_dispatch import sp_forward, split_forward
from parallel3d.mesh import ParallelContext
from parallel3d.params import in_backward
from parallel3d.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, column_entry, enter_tp_region,
                                        reduce_from_tp)

AUX_SCOPES = ("global", "local")


def check_aux_scope(scope: str) -> None:
    """model.moe_aux_scope: where the balancing statistics come from (see the module docstring)."""
    if scope not in AUX_SCOPES:
        raise ValueError(f"model.moe_aux_scope must be one of {', '.join(AUX_SCOPES)}, got {scope!r}")


class _SumLocalGrad(torch.autograd.Function):
    """All-reduce (sum) forward, identity backward: see the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:
        return comm.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class SharedExperts(nn.Module):
    """Always-on SwiGLU expert(s) (DeepSeek): column-parallel gate/up, row-parallel down. Without sequence
    parallelism it returns the partial (pre-reduce) output, so the MoE layer reduces routed and shared
    outputs together; with it, the shard's whole output."""

    def __init__(self, hidden: int, ffn_hidden: int, tp: Group, sp: bool, backend: str,
                 std: Optional[float] = None) -> None:
        super().__init__()
        self.backend, self.sp = backend, sp
        self.gate_proj = ColumnParallelLinear(hidden, ffn_hidden, tp, sp, enter_region=False, std=std)
        self.up_proj = ColumnParallelLinear(hidden, ffn_hidden, tp, sp, enter_region=False, std=std)
        self.down_proj = RowParallelLinear(ffn_hidden, hidden, tp, sp, std=std, reduce=sp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, h) tokens inside the TP region -> (T, h) partial over TP; with sp the (b, s/tp, h) shard ->
        (b, s/tp, h): column_entry gathers it and keeps only the shard, down_proj reduce-scatters."""
        if self.sp:
            gate, up = column_entry(x, (self.gate_proj, self.up_proj), self.gate_proj.group, True)  # (b, s, f/tp)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)  # (T, f/tp)
        return self.down_proj(kernels.swiglu(gate, up, self.backend))  # (T, h) partial / (b, s/tp, h)


class MoELayer(nn.Module):
    """Drop-in replacement for the dense MLP of a block: (b, s, h) -> (b, s, h) ((b, s/tp, h) with SP)."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, top_k: int, ctx: ParallelContext,
                 sequence_parallel: bool = False, shared_ffn_hidden: int = 0, score: str = "softmax",
                 norm_topk: bool = True, aux_loss_coef: float = 0.0, z_loss_coef: float = 0.0,
                 bias_update_rate: float = 0.0, capacity_factor: float = 0.0, impl: str = "auto",
                 backend: str = "auto", std: Optional[float] = None, num_groups: int = 1, topk_groups: int = 1,
                 routed_scaling_factor: float = 1.0, seq_aux_loss_coef: float = 0.0,
                 aux_scope: str = "global", delay_wgrad: bool = False) -> None:
        super().__init__()
        check_aux_scope(aux_scope)
        if delay_wgrad:
            check_delay_wgrad(ctx.ep.size, ctx.etp.size)
        self.delay_wgrad = delay_wgrad  # model.moe_delay_wgrad (delayed_wgrad.py)
        self.tp, self.ep, self.etp, self.cp, self.dp_cp = ctx.tp, ctx.ep, ctx.etp, ctx.cp, ctx.dp_cp
        self.interleave = ctx.interleave  # a pipeline pair's turns (interleave.py): the exchange switches there
        # the all-to-alls the exchange starts, on a clone of EP where the trainer made one (ep_overlap): inside a
        # pair they are in flight while the partner runs blocking collectives on EP and DP x CP, and host reads
        self.ep_async = ctx.cloned("ep")
        self.aux_scope = aux_scope
        self.sp = sequence_parallel and ctx.tp.size > 1
        self.num_experts, self.top_k = num_experts, top_k
        self.aux_loss_coef, self.z_loss_coef, self.seq_aux_loss_coef = aux_loss_coef, z_loss_coef, seq_aux_loss_coef
        self.bias_update_rate, self.capacity_factor = bias_update_rate, capacity_factor
        self.router = Router(hidden, num_experts, top_k, ctx.tp, score, norm_topk, std=std, num_groups=num_groups,
                             topk_groups=topk_groups, scaling_factor=routed_scaling_factor)
        self.experts = GroupedExperts(num_experts, hidden, ffn_hidden, ctx.ep, ctx.etp, impl, backend, std=std)
        self.shared_experts = (SharedExperts(hidden, shared_ffn_hidden, ctx.tp, self.sp, backend, std=std)
                               if shared_ffn_hidden else None)
        self._aux_term: Optional[torch.Tensor] = None
        self._tape: Optional[SplitTape] = None  # set while a checkpointed forward or its recomputation runs
        self.last_aux: dict[str, torch.Tensor] = {}  # name -> device scalar of the last micro-batch (this rank's view)
        self.reset_load()

    # ---- forward ------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x (b, s_local[/tp], h); positions (s_local,) of the tokens (capacity under CP ranks slots by them)."""
        if self.sp:  # every TP rank dispatches its own tokens (sp_dispatch.py)
            return sp_forward(self, x, positions)
        x = enter_tp_region(x, self.tp, False)  # (b, s, h)
        if self.etp.ranks != self.tp.ranks:  # experts folded across TP ranks: each dispatches its share
            return reduce_from_tp(split_forward(self, x, positions), self.tp)
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)  # (T, h)
        r = self.router(tokens)
        keep = self.decide(r, b, s, positions)
        exchange = self.exchange(r.indices, keep, b * s * self.top_k)
        perm = permute(r.indices, self.num_experts, keep, kept=exchange.rows_sent)
        rows = exchange.combine(self.run_experts(exchange, tokens[perm.token_index]))  # (N_send, h) sorted slots
        out = unpermute(rows, perm, r.weights)  # (T, h) partial over TP
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return reduce_from_tp(out.view(b, s, h), self.tp)

    def run_experts(self, exchange: ExpertExchange, rows: torch.Tensor) -> torch.Tensor:
        """rows (N_send, h) sorted by global expert -> (N_recv, h) the local experts' outputs, expert-major:
        dispatched, then run; with model.moe_delay_wgrad one node (delayed_wgrad.py), whose backward starts
        the input gradient's all-to-all before the experts' weight gradients."""
        if self.delay_wgrad and exchange.regroup is not None and torch.is_grad_enabled():
            return self.experts(rows, exchange.local_counts, dispatched=dispatched_experts(exchange))
        return self.experts(exchange.dispatch(rows), exchange.local_counts)  # (N_recv, h)

    def decide(self, r: Routing, b: int, s: int, positions: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The routing r of b x s tokens -> its capacity keep mask (T, k) or None; counts the load and keeps
        the auxiliary term (the same for every layout: r covers the whole TP-local sequence)."""
        keep = None
        if self.capacity_factor > 0:
            cap = expert_capacity(self.capacity_factor, s * self.cp.size, self.top_k, self.num_experts)
            keep = sharded_capacity_keep_mask(r.indices.view(b, s, -1), cap, self.num_experts, self.cp,
                                              positions).reshape(b * s, -1)  # (T, k)
        counts = expert_counts(r.indices, self.num_experts)  # (E,) routed slots before drops
        if self.training and torch.is_grad_enabled() and not in_backward():
            self._observe(counts, keep, r.indices)
        if torch.is_grad_enabled() and (self.aux_loss_coef or self.z_loss_coef or self.seq_aux_loss_coef):
            term = self._aux(r, counts, b * s, b)
            if not in_backward():
                self._aux_term = term
        return keep

    def exchange(self, indices: torch.Tensor, keep: Optional[torch.Tensor], num_rows: int,
                 tp: Optional[Group] = None) -> ExpertExchange:
        """The layer's one host sync: the exchange reads the split sizes (a recomputation replays them)."""
        tape = self._tape
        known = tape.replay() if tape is not None and tape.replaying else None
        exchange = ExpertExchange(kept_counts(indices, self.num_experts, keep), self.ep, num_rows, known, tp,
                                  self.interleave, self.ep_async)
        if tape is not None and not tape.replaying:
            tape.record(exchange.host)
        return exchange

    # ---- auxiliary losses -------------------------------------------------------------------------------
    def _aux(self, r: Routing, counts: torch.Tensor, num_tokens: int, batch: int) -> torch.Tensor:
        e = self.num_experts
        probs = balance_probs(r.scores, self.router.score)  # (T, E)
        tokens_here = torch.full((1,), float(num_tokens), device=counts.device)  # no host-to-device copy
        local = torch.cat([probs.sum(0), z_loss_sum(r.logits)[None], counts.float(), tokens_here])  # (2E+2,)
        scoped = self.aux_scope == "global" and self.dp_cp.size > 1
        glob = _SumLocalGrad.apply(local, self.dp_cp) if scoped else local
        prob_sum, z_sum, count_sum, tokens = glob[:e], glob[e], glob[e + 1:2 * e + 1], glob[-1].detach()
        aux = switch_aux_loss(prob_sum, count_sum.detach(), tokens, self.top_k)
        z = z_sum / tokens
        stats = {"aux_loss": aux.detach(), "z_loss": z.detach()}  # device scalars, read at log time
        total = self.aux_loss_coef * aux + self.z_loss_coef * z
        if self.seq_aux_loss_coef:
            seq_aux = self._sequence_aux(probs, r.indices, batch)
            stats["seq_aux_loss"] = seq_aux.detach()
            total = total + self.seq_aux_loss_coef * seq_aux
        if not in_backward():  # recomputation repeats the same values
            self.last_aux = stats
        ranks = self.dp_cp.size if self.aux_scope == "global" else 1  # ranks holding the same value
        grad_weight, value_weight = tokens / self.tp.size, tokens / ranks
        return total * grad_weight + (total * (value_weight - grad_weight)).detach()

    def _sequence_aux(self, probs: torch.Tensor, indices: torch.Tensor, batch: int) -> torch.Tensor:
        """DeepSeek-V3 sequence-wise balance loss averaged over the global micro-batch's sequences (same value
        on every rank). A sequence split over CP has its sums all-reduced over CP first; then each CP rank
        holds that sequence's loss, so its *value* counts 1/cp per rank, while its *gradient* (which reaches
        only the rank's own tokens, the all-reduces passing gradients through) counts fully."""
        stats = sequence_balance_stats(probs, indices, batch)  # (b, 2E) over local tokens
        if self.aux_scope == "local":  # this rank's part of each sequence; no collective
            loss = sequence_balance_loss(stats, probs.shape[0] // batch, self.top_k)  # (b,)
            return loss.sum() / batch
        if self.cp.size > 1:
            stats = _SumLocalGrad.apply(stats, self.cp)  # (b, 2E) whole sequences
        seq_len = probs.shape[0] // batch * self.cp.size
        sequences = batch * (self.dp_cp.size // self.cp.size)  # in the global micro-batch
        grad_part = sequence_balance_loss(stats, seq_len, self.top_k).sum() / sequences
        local = grad_part + (grad_part / self.cp.size - grad_part).detach()
        return _SumLocalGrad.apply(local[None], self.dp_cp)[0] if self.dp_cp.size > 1 else local

    def recompute_contexts(self) -> tuple:
        """torch.utils.checkpoint's context_fn for a block holding this layer: the checkpointed forward records
        its split sizes, the recomputation replays them, so full recomputation adds no host sync."""
        tape = SplitTape()
        return Taping(self, tape, False), Taping(self, tape, True)

    def pop_aux_loss(self) -> Optional[torch.Tensor]:
        """This layer's auxiliary term of the last forward (summed-loss units, see module doc), then forget it."""
        term, self._aux_term = self._aux_term, None
        return term

    # ---- load telemetry and auxiliary-loss-free balancing --------------------------------------------------
    def reset_load(self) -> None:
        """Forget the counted load. The (2, E) int64 counter [routed, dropped slots per expert] lives on the
        device and is created by the first forward that counts."""
        self._load: Optional[torch.Tensor] = None

    @torch.no_grad()
    def _observe(self, counts: torch.Tensor, keep: Optional[torch.Tensor], indices: torch.Tensor) -> None:
        """Add one micro-batch's routed (and dropped) slots, on the device: no host sync."""
        if self._load is None:
            self._load = counts.new_zeros(2, self.num_experts)  # (2, E) int64: exact in any order
        self._load[0] += counts
        if keep is not None:  # a scatter-add weighted by the drop mask: no data-dependent shape, no sync
            self._load[1].scatter_add_(0, indices.flatten(), (~keep).flatten().long())

    def local_load(self) -> torch.Tensor:
        """(2, E) float64 [routed, dropped] slots per expert seen by this rank since the last reset, on the
        device of the router."""
        if self._load is None:
            return torch.zeros(2, self.num_experts, dtype=torch.float64, device=self.router.weight.device)
        return self._load.double()

    @torch.no_grad()
    def update_bias(self, global_load: torch.Tensor) -> None:
        """DeepSeek-V3 bias step from the global per-expert load of the step (no-op when the rate is 0)."""
        if self.bias_update_rate > 0:
            update_expert_bias(self.router.expert_bias, global_load.to(self.router.expert_bias.device),
                               self.bias_update_rate)
