"""The MoE layer when every rank dispatches only its own tokens: under sequence parallelism the (b, s/tp)
shard, so the layer keeps 1/tp of its activations (Megatron's all-to-all dispatcher order with expert tensor
parallelism), and without it, when the experts are folded across TP ranks (etp != tp), a 1/tp share of the
replicated tokens (split_forward).

    route           on the shard (sp_entry.py); capacity, auxiliary losses and telemetry read the routing
                    gathered along the sequence, exactly as on the gathered tokens
    permute         this rank's tokens' kept slots, sorted by expert
    all-to-all      over EP (folded over TP x CP x DP, mesh_spec.py): each rank carries its own tokens' rows
    all-gather      (etp > 1) the received rows over the etp group (every etp rank holds its ffn slice of
                    every local expert, so it needs the rows of all etp ranks), regrouped expert-major
    experts         gate/up (ffn/etp columns) keep only this rank's rows and gather them again in backward
                    (what column_entry does for the dense layers); down gives partial sums over etp
    reduce-scatter  (etp > 1) the partial outputs over etp, back to this rank's rows, now whole
    all-to-all      back over EP; combine with this rank's combine weights -> (b, s/tp, h): no TP sum left
    shared experts  column_entry on the shard (the dense MLP's TP); partial (b, s, h) reduce-scattered to it

With etp = 1 (whole experts per rank) there is no collective inside the layer but the EP all-to-alls (and the
router's gathers): its activations are 1/tp of tp=1's. etp ranks receive different numbers of rows: the
all-gather and reduce-scatter pad every rank's rows to the largest count. The counts ride along with the
exchange's one host read (ExpertExchange(tp=...)).

Communication over etp: the routed rows cross the etp group instead of the tokens. Per MoE layer, forward
runs one all-gather and one reduce-scatter of etp * max_r(rows_r) ~ T*k rows (T tokens of the etp group, k
routed slots each, fewer with drops), backward two all-gathers (the output gradient, the saved rows again)
and one reduce-scatter (the input gradient) of the same size. The EP all-to-alls carry each rank's own rows.
"""
from __future__ import annotations

from itertools import accumulate
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.expert_parallel.dispatch import permute, unpermute
from parallel3d.expert_parallel.experts import (GroupedExperts, choose_impl, grouped_linear, grouped_weight_grad,
                                               offsets)
from parallel3d.expert_parallel.sp_entry import route_on_shard
from parallel3d.host_sync import upload
from parallel3d.kernels import dispatch as kernels
from parallel3d.tensor_parallel.region import will_run


class TPRows:
    """Where the rows each etp rank (expert tensor parallelism; `group`) received go among the expert-major rows
    of all its ranks.

    tp_counts[r][e]: rows etp rank r received for local expert e (host ints). Rank r's rows sit, padded to
    `width` rows, at [r * width, (r + 1) * width) of the gathered buffer, expert-major; `index` picks, for
    every row of the expert-major order (expert, then TP rank, then the rank's own order), its padded row."""

    def __init__(self, tp_counts: Sequence[Sequence[int]], group: Group, device: torch.device) -> None:
        self.group = group
        ranks, experts = len(tp_counts), len(tp_counts[0])
        sizes = [sum(c) for c in tp_counts]
        self.mine, self.width = sizes[group.rank], max(max(sizes), 1)
        self.counts = [sum(tp_counts[r][e] for r in range(ranks)) for e in range(experts)]  # (E_local,)
        starts = [[0, *accumulate(c)] for c in tp_counts]  # where expert e starts in rank r's own rows
        lengths, shifts, dst = [], [], 0
        for e in range(experts):
            for r in range(ranks):
                lengths.append(tp_counts[r][e])
                shifts.append(r * self.width + starts[r][e] - dst)
                dst += tp_counts[r][e]
        self.offs: Optional[torch.Tensor] = None  # grouped_mm's offsets of self.counts, uploaded once (run)
        shift = upload(torch.tensor(shifts), device)  # (tp * E_local,) padded row - expert-major row
        self.index = (torch.repeat_interleave(shift, upload(torch.tensor(lengths), device), output_size=dst)
                      + torch.arange(dst, device=device))  # (N_all,)

    def start_gather(self, rows: torch.Tensor) -> tuple:
        """Start the all-gather of this rank's rows (n_r, h), padded to `width`."""
        padded = F.pad(rows, (0, 0, 0, self.width - self.mine))  # (width, h)
        buf = rows.new_empty(self.group.size * self.width, rows.shape[1])  # (tp * width, h)
        return buf, comm.start_all_gather(buf.view(-1), padded.view(-1), self.group), padded

    def finish_gather(self, pending: tuple) -> torch.Tensor:
        buf, work, _ = pending  # (the padded source stays alive until the gather is done)
        comm.wait_work(work, self.group, "all_gather")
        return buf[self.index]  # (N_all, h) expert-major

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """(n_r, h) this rank's rows -> (N_all, h) all TP ranks' rows, expert-major."""
        return self.finish_gather(self.start_gather(rows))

    def run(self, experts: GroupedExperts, rows: torch.Tensor) -> torch.Tensor:
        """The grouped experts on the rows of all TP ranks: (n_r, h) this rank's received rows, expert-major ->
        (n_r, h) their outputs, whole (GroupedExperts.forward with tp_rows). "padded" runs as the loop here."""
        impl = choose_impl(experts.impl, rows, rows.shape[1], experts.gate_proj.shape[1])
        impl = "loop" if impl == "padded" else impl
        if impl == "grouped_mm" and self.offs is None:
            self.offs = offsets(self.counts, rows.device)  # (E_local,) for all five grouped GEMMs
        gate, up = _GatherUpGate.apply(rows, experts.gate_proj, experts.up_proj, self, impl)  # (N_all, f/tp)
        hid = kernels.swiglu(gate, up, experts.backend)  # (N_all, f/tp)
        out = grouped_linear(impl, hid, self.counts, experts.down_proj, offs=self.offs)  # (N_all, h) partial
        return _ReduceScatterRows.apply(out, self)  # (n_r, h)

    def reduce_scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """(N_all, h) partial sums over TP, expert-major -> (n_r, h) this rank's rows, summed over TP."""
        padded = rows.new_zeros(self.group.size * self.width, rows.shape[1]).index_copy_(0, self.index, rows)
        return comm.reduce_scatter(padded, self.group)[:self.mine]  # (n_r, h)


class _GatherUpGate(torch.autograd.Function):
    """this rank's rows (n_r, h) -> gate, up (N_all, f/tp) over the rows of all TP ranks, saving only the
    rows this rank received (the gathered (N_all, h) is tp times larger)."""

    @staticmethod
    def forward(ctx, rows, w_gate, w_up, plan: TPRows, impl: str):
        x = plan.gather(rows)  # (N_all, h)
        gate = grouped_linear(impl, x, plan.counts, w_gate, offs=plan.offs)  # (N_all, f/tp)
        up = grouped_linear(impl, x, plan.counts, w_up, offs=plan.offs)  # (N_all, f/tp)
        ctx.plan, ctx.impl = plan, impl
        ctx.save_for_backward(rows, w_gate, w_up)
        return gate, up

    # gate_e = X_e Wg_e^T, up_e = X_e Wu_e^T over expert e's rows X_e of all TP ranks:
    #   dX_e = dgate_e Wg_e + dup_e Wu_e      partial over TP (this rank's ffn slice): reduce-scattered to the
    #                                         rows this rank received, whole
    #   dWg_e = dgate_e^T X_e, dWu_e = dup_e^T X_e   with X gathered again from the saved rows
    # A zero-bubble input pass needs no dW and a weight pass no dX (pipeline/backward.py): each is skipped
    # alike on every TP rank (the graph is the same), with its collectives.
    @staticmethod
    def backward(ctx, dgate, dup):
        rows, w_gate, w_up = ctx.saved_tensors
        plan, impl = ctx.plan, ctx.impl
        need = [ctx.needs_input_grad[i] and will_run(ctx.next_functions[i][0]) for i in range(3)]
        pending = plan.start_gather(rows) if need[1] or need[2] else None  # under the dX GEMMs on NCCL
        dgate, dup = dgate.contiguous(), dup.contiguous()
        dx = dwg = dwu = None
        if need[0]:
            dx = grouped_linear(impl, dgate, plan.counts, w_gate, True, plan.offs)  # (N_all, h)
            dx = plan.reduce_scatter(dx.add_(grouped_linear(impl, dup, plan.counts, w_up, True, plan.offs)))
        if pending is not None:
            x = plan.finish_gather(pending)  # (N_all, h)
            dwg = grouped_weight_grad(impl, dgate, x, plan.counts, plan.offs).to(w_gate.dtype) if need[1] else None
            dwu = grouped_weight_grad(impl, dup, x, plan.counts, plan.offs).to(w_up.dtype) if need[2] else None
        return dx, dwg, dwu, None, None


class _ReduceScatterRows(torch.autograd.Function):
    """(N_all, h) partial expert outputs of all TP ranks' rows -> (n_r, h) this rank's rows, summed."""

    @staticmethod
    def forward(ctx, rows, plan: TPRows):
        ctx.plan = plan
        return plan.reduce_scatter(rows)

    # y_r = sum over TP ranks of their partial rows for rank r: every rank's partial rows get dy_r, i.e. the
    # output gradients of all TP ranks' rows, gathered.
    @staticmethod
    def backward(ctx, dy):
        return ctx.plan.gather(dy.contiguous()), None


def own_tokens_forward(layer, tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                       keep: Optional[torch.Tensor]) -> torch.Tensor:
    """This rank's tokens (T_r, h) with their routing (T_r, k) -> (T_r, h) routed output, whole: dispatch over
    EP, the local experts (with the other etp ranks' rows when etp > 1), combine back (module docstring)."""
    etp = layer.etp if layer.etp.size > 1 else None
    exchange = layer.exchange(indices, keep, tokens.shape[0] * layer.top_k, etp)
    perm = permute(indices, layer.num_experts, keep, kept=exchange.rows_sent)
    if etp is None:  # whole experts: dispatched and run (with model.moe_delay_wgrad, as one node)
        rows = layer.run_experts(exchange, tokens[perm.token_index])  # (n_r, h) by local expert
    else:
        rows = exchange.dispatch(tokens[perm.token_index])  # (n_r, h) by local expert
        rows = layer.experts(rows, exchange.local_counts, TPRows(exchange.tp_counts, etp, tokens.device))
    rows = exchange.combine(rows)  # (N_send, h) sorted slots
    return unpermute(rows, perm, weights)  # (T_r, h) whole


def sp_forward(layer, x: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
    """MoELayer.forward under sequence parallelism: x (b, s/tp, h) -> (b, s/tp, h) (module docstring)."""
    tp, k = layer.tp, layer.top_k
    b, s_local, h = x.shape
    r, local = route_on_shard(layer.router, x, tp)  # gathered (T, .) and this rank's (b * s/tp, .)
    keep = layer.decide(r, b, s_local * tp.size, positions)  # (T, k) or None
    if keep is not None:  # this rank's part of the sequence (gather_from_sp stacks the TP ranks' parts)
        keep = keep.view(b, tp.size, s_local, k)[:, tp.rank].reshape(b * s_local, k)  # (b * s/tp, k)
    out = own_tokens_forward(layer, x.reshape(b * s_local, h), local.indices, local.weights, keep)
    out = out.view(b, s_local, h)  # (b, s/tp, h) whole
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x)  # (b, s/tp, h)
    return out


def split_forward(layer, x: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
    """MoELayer.forward without sequence parallelism when the experts are folded across TP ranks (etp != tp):
    x (b, s, h) inside the TP region, the same on every TP rank -> (b, s, h) partial over TP.

    Every TP rank routes all T = b*s tokens alike (capacity, auxiliary losses and telemetry as at tp=1) and
    dispatches only its share [lo, hi) of them (EP spans TP ranks, so replicated tokens must not be sent
    twice); its whole outputs sit at its rows of a zero (T, h), so the layer's one TP all-reduce (after the
    shared experts' partial output is added) completes every row. Backward: the all-reduce passes the whole
    output gradient, the padding hands each rank its rows' part; the router weight's gradient (combine weights
    of this rank's tokens) and the input's are partial over TP (meta.grad_reduce, enter_tp_region)."""
    tp = layer.tp
    b, s, h = x.shape
    tokens = x.reshape(b * s, h)  # (T, h)
    r = layer.router(tokens)
    keep = layer.decide(r, b, s, positions)  # (T, k) or None
    share = comm.even_split(b * s, tp.size)
    lo = sum(share[:tp.rank])
    hi = lo + share[tp.rank]
    mine = own_tokens_forward(layer, tokens[lo:hi], r.indices[lo:hi], r.weights[lo:hi],
                              keep[lo:hi] if keep is not None else None)  # (T_r, h) whole
    out = F.pad(mine, (0, 0, lo, b * s - hi))  # (T, h) this rank's rows, zeros elsewhere
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(tokens)  # (T, h) partial over TP
    return out.view(b, s, h)
