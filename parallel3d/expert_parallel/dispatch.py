"""Token permutation and the expert-parallel all-to-all (dispatch / combine).

A routed *slot* is one (token, choice) pair; T tokens with top-k give T*k slots, numbered t*k + j.

    exchange     all-to-all of the per-expert counts of the kept slots first, so every rank knows how many
                 rows it will receive from each source for each of its local experts (the uneven splits);
                 the one host sync of the layer reads the sent and received counts together
    permute      sort the kept slots by expert (stable: token order within an expert)
    dispatch     all-to-all of the sorted rows; regroup the received (source-major) rows expert-major
    experts      run the local experts on contiguous row ranges (experts.py)
    combine      undo the regrouping, all-to-all back with the splits swapped
    unpermute    put every slot's output back in its place, weight by the combine weights, sum over k

A recomputed forward (activation checkpointing) replays the split sizes its forward read (SplitTape, lent
to the layer by Taping) instead of reading the counts on the host again.

Expert e lives on EP rank e // E_local. Dropped slots (capacity) are never sent. The per-token sum over
its k slots runs in a fixed order (choice order), so results do not depend on how tokens are spread over
ranks; only the size of matrix products changes, which keeps layouts within fp32 rounding.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.expert_parallel.router import expert_counts
from parallel3d.host_sync import read_list
from parallel3d.interleave import Interleave


@dataclass
class Permutation:
    """Slots sorted by expert. `order[i]` is the slot (t*k + j) at sorted row i; dropped slots excluded."""
    order: torch.Tensor    # (N,) int64 slot ids, expert-major
    counts: torch.Tensor   # (E,) int64 kept slots per expert
    num_tokens: int
    top_k: int

    @property
    def token_index(self) -> torch.Tensor:
        return self.order // self.top_k  # (N,) token of each sorted row


def _slot_experts(indices: torch.Tensor, num_experts: int, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """(T*k,) expert of every slot; dropped slots get the id num_experts (they sort last)."""
    expert = indices.flatten()  # (T*k,)
    if keep is None:
        return expert
    return torch.where(keep.flatten(), expert, torch.full_like(expert, num_experts))


def kept_counts(indices: torch.Tensor, num_experts: int, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(E,) int64 kept slots per expert, on the device (what the exchange sends)."""
    return expert_counts(_slot_experts(indices, num_experts, keep), num_experts + 1)[:num_experts]


def permute(indices: torch.Tensor, num_experts: int, keep: Optional[torch.Tensor] = None,
            kept: Optional[int] = None) -> Permutation:
    """indices (T, k) chosen experts, keep (T, k) bool or None -> Permutation. With a keep mask, `kept` is
    the number of kept slots (a host int: the sum of the exchange's host counts), so permuting needs no
    read of the device."""
    num_tokens, top_k = indices.shape
    if keep is not None and kept is None:
        raise ValueError("permute with a keep mask needs kept= (the kept slots, e.g. ExpertExchange.rows_sent)")
    expert = _slot_experts(indices, num_experts, keep)  # (T*k,)
    order = torch.argsort(expert, stable=True)  # (T*k,)
    if keep is not None:
        order = order[:kept]  # (N,) dropped slots sorted last
    return Permutation(order, kept_counts(indices, num_experts, keep), num_tokens, top_k)


def unpermute(rows: torch.Tensor, perm: Permutation, weights: torch.Tensor) -> torch.Tensor:
    """rows (N, h) expert outputs in sorted order, weights (T, k) -> (T, h) weighted sum over the k slots.

    Dropped slots contribute zero. The weighting and sum are fp32, the result is cast to rows' dtype.
    """
    h = rows.shape[-1]
    slots = rows.new_zeros(perm.num_tokens * perm.top_k, h).index_copy(0, perm.order, rows)  # (T*k, h)
    slots = slots.view(perm.num_tokens, perm.top_k, h).float()  # (T, k, h)
    return (slots * weights.unsqueeze(-1)).sum(1).to(rows.dtype)  # (T, h)


def rank_load(tokens_per_expert: list, ep: int) -> float:
    """How unevenly one MoE layer's routed slots (per expert, summed over a step) fell on the EP ranks: the
    busiest rank's share over the mean share (expert e lives on rank e // (E / ep)). 1.0 is balanced; the
    planner's `--moe-load` routes the planned rank this multiple of the balanced share."""
    local = len(tokens_per_expert) // ep
    per_rank = [sum(tokens_per_expert[r * local:(r + 1) * local]) for r in range(ep)]
    total = sum(per_rank)
    return max(per_rank) * ep / total if total else 1.0


def check_expert_load(load: float, ep: int, capacity_factor: float) -> None:
    """A planned routing load (`--moe-load`): between balanced (1) and every slot on one rank (ep), and with a
    capacity no more than it lets an expert take (capacity_factor times the balanced share)."""
    if ep < 2 and load != 1.0:
        raise ValueError(f"--moe-load {load}: routing load across EP ranks needs an MoE layout with parallel.ep > 1")
    most = max(1.0, min(ep, capacity_factor) if capacity_factor > 0 else ep)
    if not 1.0 <= load <= most:
        cap = (f", nor model.capacity_factor={capacity_factor:g} (what an expert may take)"
               if capacity_factor > 0 else "")
        raise ValueError(f"--moe-load {load} must be in [1, {most:g}]: 1 is balanced routing, and the busiest "
                         f"rank takes no more than parallel.ep={ep} times its share (every slot){cap}")


def _inverse(p: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(p)
    inv[p] = torch.arange(p.numel(), device=p.device)
    return inv


class ExpertExchange:
    """One dispatch/combine round trip over the EP group, planned from this rank's per-expert counts.

    Construction exchanges the counts (one all-to-all of E int64 per rank): recv[src, e] is how many rows
    source rank `src` sends to this rank's local expert e. That fixes the uneven splits of both directions.
    The all-to-all with uneven splits needs them on the host: one read of the sent and received counts
    together (host-sync category "moe_splits"). `num_rows` is the number of slots this rank routes (the dry
    run assumes no drops and spreads them evenly over the experts; its absent peers send this rank's experts
    `comm.simulated_expert_load` times their balanced share: the planner's `--moe-load`).

    `tp` (the expert tensor-parallel group when etp > 1, sp_dispatch.py): every rank dispatches its own
    tokens, and the rows it receives are later gathered over that group, so the counts of all its ranks are
    all-gathered before the read and ride along with it (still one read); `tp_counts[r]` is its rank r's rows
    per local expert.
    """

    def __init__(self, counts: torch.Tensor, group: Group, num_rows: int, known: Optional[list] = None,
                 tp: Optional[Group] = None, interleave: Optional[Interleave] = None,
                 async_group: Optional[Group] = None) -> None:
        """`known`: the host counts (`self.host`) of an earlier exchange of the same routing, e.g. the forward
        that an activation recomputation repeats: used instead of reading the device again. `interleave`:
        inside one of its pairs, dispatch and combine (and their backwards) are started, the partner computes,
        then they are waited (interleave.py). `async_group`: where every all-to-all this exchange starts (and
        waits later) runs, a clone of `group` with its own queue where the trainer made one: no blocking
        collective of the partner on EP or on a group sharing its process group (DP x CP at ep == dp: the
        balancing statistics) then waits behind rows in flight, nor the host read that follows it."""
        self.interleave, self.async_group = interleave, async_group or group
        ep, num_experts = group.size, counts.numel()
        if num_experts % ep:
            raise ValueError(f"model.num_experts={num_experts} is not divisible by parallel.ep={ep}")
        self.group, self.local_experts = group, num_experts // ep
        # a dry run has no routing decisions: it assumes balanced routing of the rows it holds
        nominal = comm.even_split(num_rows, num_experts)
        syncs = group.stats.syncs if group.stats is not None else None
        recv = None
        if ep == 1:
            device, nominal_host = counts, nominal  # (E,) sent
        else:
            recv = comm.all_to_all(counts.contiguous(), group).view(ep, self.local_experts)  # (ep, E_local)
            load = comm.simulated_expert_load(group)
            mine = [round(n * load) for n in nominal[group.rank * self.local_experts:(group.rank + 1) *
                                                     self.local_experts]]
            device, nominal_host = torch.cat([counts, recv.flatten()]), nominal + mine * ep  # (2E,)
        ranks, rank = (tp.size, tp.rank) if tp is not None else (1, 0)
        if ranks > 1 and known is None:
            device = comm.all_gather(device, tp)  # (tp * len,) every TP rank's counts, in TP rank order
        both = known if known is not None else read_list(device, syncs, "moe_splits", nominal_host * ranks)
        self.host, width = both, len(both) // ranks
        rows = [both[r * width:(r + 1) * width] for r in range(ranks)]
        self.tp_counts = [self._local_counts(row, ep, num_experts) for row in rows]
        both = rows[rank]
        if ep == 1:
            self.send_splits = self.recv_splits = [sum(both)]
            self.local_counts, self.rows_sent = both, sum(both)
            self.regroup = None
            return
        sent, received = both[:num_experts], both[num_experts:]  # (E,) sent; [src-major] (ep * E_local,)
        self.rows_sent = sum(sent)
        self.send_splits = [sum(sent[r * self.local_experts:(r + 1) * self.local_experts]) for r in range(ep)]
        self.recv_splits = [sum(received[r * self.local_experts:(r + 1) * self.local_experts]) for r in range(ep)]
        self.local_counts = self.tp_counts[rank]  # rows per local expert
        expert_of_row = torch.repeat_interleave(
            torch.arange(self.local_experts, device=counts.device).repeat(ep), recv.flatten(),
            output_size=sum(self.recv_splits))  # (N_recv,)
        self.regroup = torch.argsort(expert_of_row, stable=True)  # source-major -> expert-major
        self.ungroup = _inverse(self.regroup)

    def _local_counts(self, host: list, ep: int, num_experts: int) -> list:
        """Rows per local expert from one rank's host counts ([sent] at ep=1, else [sent | received])."""
        if ep == 1:
            return list(host)
        received = host[num_experts:]
        return [sum(received[r * self.local_experts + e] for r in range(ep)) for e in range(self.local_experts)]

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """(N_send, h) sorted by global expert -> (N_recv, h) sorted by local expert (source order inside)."""
        if self.regroup is None:
            return rows
        return _AllToAll.apply(rows, self, True)[self.regroup]  # (N_recv, h) expert-major

    def exchange_rows(self, rows: torch.Tensor, forward: bool) -> torch.Tensor:
        """The all-to-all alone (no autograd): forward (N_send, h) -> (N_recv, h) source-major, or back. Inside
        an interleaved pair it is started, the partner computes while it travels, then it is waited."""
        if self.interleave is None or not self.interleave.active:
            return comm.all_to_all(rows, self.group, *self._splits(forward))
        return self.finish_rows(self.start_rows(rows, forward))

    def start_rows(self, rows: torch.Tensor, forward: bool) -> tuple:
        """Start that all-to-all (whatever the rank runs next travels beside it); finish_rows waits."""
        out_splits, in_splits = self._splits(forward)
        rows = rows.contiguous()  # (kept in the handle until the wait: the transfer reads it)
        out = rows.new_empty((sum(out_splits),) + tuple(rows.shape[1:]))  # (N_out, h)
        return out, comm.start_all_to_all(out, rows, self.async_group, out_splits, in_splits), rows

    def finish_rows(self, pending: tuple) -> torch.Tensor:
        """Inside an interleaved pair the partner takes its turn first; then wait for the rows."""
        out, work, _ = pending
        if self.interleave is not None:
            self.interleave.switch()
        comm.wait_work(work, self.async_group, "all_to_all")
        return out

    def _splits(self, forward: bool) -> tuple[list, list]:
        return (self.recv_splits, self.send_splits) if forward else (self.send_splits, self.recv_splits)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """(N_recv, h) expert outputs, expert-major -> (N_send, h) back on the source ranks, sorted order."""
        if self.regroup is None:
            return rows
        return _AllToAll.apply(rows[self.ungroup], self, False)


class _AllToAll(torch.autograd.Function):
    """The exchange's all-to-all, dispatch (forward=True) or combine. Backward: dL/dx is the all-to-all of
    dL/dout the other way (each row goes back to where it came from), overlapped the same way."""

    @staticmethod
    def forward(ctx, x, exchange: ExpertExchange, forward: bool):
        ctx.exchange, ctx.forward = exchange, forward
        return exchange.exchange_rows(x, forward)

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange.exchange_rows(grad, not ctx.forward), None, None


class SplitTape:
    """The host split sizes of one checkpointed forward of a layer, in call order, replayed by each of its
    recomputations (which route the same tokens the same way: checkpointing requires identical shapes)."""

    def __init__(self) -> None:
        self.rows: list = []
        self.replaying, self._next = False, 0

    def record(self, host: list) -> None:
        self.rows.append(host)

    def replay(self) -> list:
        if self._next >= len(self.rows):
            raise RuntimeError("a recomputed MoE forward exchanged more often than the forward it repeats")
        self._next += 1
        return self.rows[self._next - 1]


class Taping:
    """The context the checkpointed forward runs in (record) and each recomputation of it (replay): it lends
    `tape` to the layer (an MoE layer's `_tape`, which its exchanges record into or replay from). A split
    backward (zb-h1, zb-v, dualpipe-v) recomputes once per pass, so this is entered more than once: a class,
    because a generator context manager can be entered only once."""

    def __init__(self, layer, tape: SplitTape, replay: bool) -> None:
        self.layer, self.tape, self.replay = layer, tape, replay

    def __enter__(self) -> None:
        self.layer._tape, self.tape.replaying, self.tape._next = self.tape, self.replay, 0

    def __exit__(self, *exc) -> None:
        self.layer._tape = None
