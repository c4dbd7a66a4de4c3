"""Ring attention: K/V blocks travel around the CP ring; partial results merge through the log-sum-exp.

Layout (see sharding.py): the sequence is cut into 2*cp chunks of c tokens, rank r holds chunks
(r, 2cp-1-r) as its local sequence [q0 | q1]. At step i (i = 0 .. cp-1) rank r holds the K/V of rank
src = (r - i) mod cp, i.e. key chunks (src, 2cp-1-src):

    cp = 2, causal           key chunks held          query chunk vs key chunk (global indices)
    rank 0, step 0 (src 0)   k: c0 c3   q: c0 c3      (0,0) diag  (0,3) skip  (3,0) full  (3,3) diag
    rank 0, step 1 (src 1)   k: c1 c2   q: c0 c3      (0,1) skip  (0,2) skip  (3,1) full  (3,2) full
    rank 1, step 1 (src 0)   k: c0 c3   q: c1 c2      (1,0) full  (1,3) skip  (2,0) full  (2,3) skip

A (query chunk a, key chunk b) pair is full when b < a, diagonal-causal when b == a and skipped when
b > a. `block_plan` turns the pairs into at most two block-attention calls per step (every rank does the
same 2c^2 work per step: that is the load balance).

Forward: before computing on the current K/V block the send/recv of it to the next rank / from the
previous one is posted (one batched p2p of the packed (2, b, s/cp, hk, d) K/V tensor), then each block's
(out_i, lse_i) is merged into the running (out, lse): out = sum_i exp(lse_i - lse) * out_i.
Backward walks the forward's steps in reverse (step i = cp-1 .. 0) and the ring the other way round:
it starts on the last K/V block the forward received (saved with the rank's own block: one extra K/V
block per layer) and ends on its own block, so the blocks in between travel from rank r+1 to rank r.
Block X is visited by ranks X-1, X-2, ..., X+1 and last by its owner X, so the dK/dV accumulator travels
the same way (each rank adds its share to the one that arrived) and its last hop lands on the owner
just before the owner's own share: no extra hop home. dQ stays local.
Per rank: forward sends cp-1 K/V blocks; backward sends max(cp-2, 0) K/V blocks and cp-1 dK/dV blocks
(cp = 2: only the one dK/dV block, overlapped with the own block's gradient math).

The next block's transfer is posted with `comm.start_batch_p2p` and waited only after this block's
math, so communication overlaps compute (gloo and NCCL both progress the p2p in the background).
"""
from __future__ import annotations

from typing import Optional

import torch

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.context_parallel.blocks import acc_dtype, block_backward, block_forward, merge_into
from parallel3d.context_parallel.documents import Documents, any_shared

# (query chunk range, key chunk range, causal) in units of local chunks (0, 1 or 2), per block call.
Plan = list[tuple[tuple[int, int], tuple[int, int], bool]]


def block_plan(rank: int, src: int, cp: int, causal: bool) -> Plan:
    """Which block attentions rank `rank` runs on the K/V of rank `src` (global chunk indices, exact)."""
    if not causal:
        return [((0, 2), (0, 2), False)]
    q_chunks = (rank, 2 * cp - 1 - rank)
    k_chunks = (src, 2 * cp - 1 - src)  # ascending, since src < cp
    if q_chunks == k_chunks:  # own K/V: the local causal mask over [c_r | c_2cp-1-r] is exact
        return [((0, 2), (0, 2), True)]
    per_query = []
    for iq, a in enumerate(q_chunks):
        n = sum(1 for kb in k_chunks if kb <= a)  # visible key chunks form a prefix (keys ascending)
        if n:
            per_query.append(((iq, iq + 1), (0, n), k_chunks[n - 1] == a))  # last one diagonal?
    if len(per_query) == 2 and per_query[0][1:] == per_query[1][1:] and not per_query[0][2]:
        return [((0, 2), per_query[0][1], False)]  # both query chunks see the same keys fully
    return per_query


def _doc_slice(x: Optional[torch.Tensor], sl: slice) -> Optional[torch.Tensor]:
    return None if x is None else x[:, sl]


def step_plan(rank: int, src: int, cp: int, causal: bool, c: int, docs: Optional[Documents]
              ) -> list[tuple[slice, slice, bool]]:
    """block_plan as (query slice, key slice, causal) in local tokens, without the blocks whose keys no
    local query can see by document (decided on the host copy of the ids). Counts into docs.counters."""
    blocks = [(slice(q0 * c, q1 * c), slice(k0 * c, k1 * c), blk) for (q0, q1), (k0, k1), blk
              in block_plan(rank, src, cp, causal)]
    if docs is None:
        return blocks
    q_host, k_host = docs.local(cp, rank, host=True), docs.local(cp, src, host=True)  # (b, s/cp)
    kept = [blk for blk in blocks if any_shared(q_host[:, blk[0]], k_host[:, blk[1]])]
    docs.count("ring_blocks", len(blocks))
    docs.count("ring_blocks_skipped", len(blocks) - len(kept))
    docs.count("ring_steps_skipped", int(not kept))
    return kept


def _ring_ops(send: torch.Tensor, recv: torch.Tensor, group: Group, shift: int = 1) -> list[comm.P2P]:
    """Send to rank r+shift, receive from rank r-shift (shift -1: the backward's direction)."""
    r, n = group.rank, group.size
    return [comm.P2P("send", send, group.ranks[(r + shift) % n]),
            comm.P2P("recv", recv, group.ranks[(r - shift) % n])]


def _covers(sl: slice, n: int) -> bool:
    return sl.start == 0 and sl.stop == n


class RingAttention(torch.autograd.Function):
    """(out (b, s/cp, hq, d), lse (b, hq, s/cp)) of the local queries against the whole sharded sequence."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, causal: bool,
                scale: float, backend: str, docs: Optional[Documents]) -> tuple[torch.Tensor, torch.Tensor]:
        cp, r = group.size, group.rank
        b, s, hq, d = q.shape
        c = s // 2
        dt = acc_dtype(q.dtype)
        out: Optional[torch.Tensor] = None  # (b, s/cp, hq, d) running output, acc dtype
        lse: Optional[torch.Tensor] = None  # (b, hq, s/cp) running log-sum-exp
        kv = own = torch.stack([k, v])  # (2, b, s/cp, hk, d) packed: one message per step, saved for backward
        q_doc = docs.local(cp, r) if docs is not None else None  # (b, s/cp) document ids of the local queries
        plans = []
        for i in range(cp):
            src = (r - i) % cp
            if i < cp - 1:  # post the next block's transfer before computing on this one
                kv_next = torch.empty_like(kv)
                pending = comm.start_batch_p2p(_ring_ops(kv, kv_next, group), group)
            k_doc = docs.local(cp, src) if docs is not None else None  # ids of the visiting K/V block
            plans.append(step_plan(r, src, cp, causal, c, docs))  # entirely masked blocks: no math
            for qs, ks, blk_causal in plans[-1]:
                o_i, l_i = block_forward(q[:, qs], kv[0][:, ks], kv[1][:, ks], blk_causal, scale, backend,
                                         _doc_slice(q_doc, qs), _doc_slice(k_doc, ks))
                if out is None and _covers(qs, s):  # the first block covering every row is the running result
                    out, lse = o_i.to(dt), l_i  # (b, s/cp, hq, d), (b, hq, s/cp): fresh tensors, merged in place
                    continue
                if out is None:
                    out = torch.zeros((b, s, hq, d), dtype=dt, device=q.device)
                    lse = torch.full((b, hq, s), float("-inf"), dtype=dt, device=q.device)
                merge_into(out[:, qs], lse[..., qs], o_i, l_i)  # out = sum_i exp(lse_i - lse) * out_i
            if i < cp - 1:
                pending.wait()
                kv = kv_next
        if out is None:  # every block skipped (possible only with documents): no query saw a key
            out = torch.zeros((b, s, hq, d), dtype=dt, device=q.device)
            lse = torch.full((b, hq, s), float("-inf"), dtype=dt, device=q.device)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, own, kv, out, lse)  # kv: the last block received
        ctx.group, ctx.scale, ctx.backend = group, scale, backend
        ctx.docs, ctx.plans = docs, plans
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout: torch.Tensor, _dlse: Optional[torch.Tensor]):
        # Each block's (dq_i, dk_i, dv_i) comes from the merged (out, lse) (blocks.py); summed over blocks it
        # is the full gradient. dQ sums locally; dK/dV of a block sum along the ring (module docstring).
        q, own, last, out, lse = ctx.saved_tensors  # own / last (2, b, s/cp, hk, d)
        group, scale, backend, docs = ctx.group, ctx.scale, ctx.backend, ctx.docs  # causality: in ctx.plans
        cp, r = group.size, group.rank
        s = q.shape[1]
        dt = acc_dtype(q.dtype)
        dq: Optional[torch.Tensor] = None  # (b, s/cp, hq, d) acc dtype
        acc: Optional[torch.Tensor] = None  # (2, b, s/cp, hk, d) dK/dV accumulator of the current block
        kv_pending = acc_pending = kv_next = None  # transfers in flight and the block arriving
        q_doc = docs.local(cp, r) if docs is not None else None
        for j in range(cp):
            i = cp - 1 - j  # the forward step whose block this is
            src = (r - i) % cp
            kv = last if j == 0 else own if i == 0 else _arrived(kv_pending, kv_next)
            if i >= 2:  # rank r-1 needs this block at its next step (at its last step it uses its own)
                kv_next = torch.empty_like(kv)
                kv_pending = comm.start_batch_p2p(_ring_ops(kv, kv_next, group, -1), group)
            k_doc = docs.local(cp, src) if docs is not None else None
            parts = []  # (key slice, dk_i, dv_i) of this step, added to the accumulator once it has arrived
            for qs, ks, blk_causal in ctx.plans[i]:  # the forward's plan: skipped blocks have no gradient
                dq_i, dk_i, dv_i = block_backward(dout[:, qs], q[:, qs], kv[0][:, ks], kv[1][:, ks], out[:, qs],
                                                  lse[..., qs], blk_causal, scale, backend,
                                                  _doc_slice(q_doc, qs), _doc_slice(k_doc, ks))
                if dq is None and _covers(qs, s):
                    dq = dq_i  # (b, s/cp, hq, d) fresh, acc dtype
                else:
                    if dq is None:
                        dq = torch.zeros(q.shape, dtype=dt, device=q.device)
                    dq[:, qs] += dq_i
                parts.append((ks, dk_i, dv_i))
            acc = _accumulate(None if j == 0 else _arrived(acc_pending, acc), parts, own.shape, dt, q.device)
            if i > 0:  # not the own block yet: the accumulator goes on to rank r-1, ours comes from r+1
                acc_out, acc = acc, torch.empty_like(acc)
                acc_pending = comm.start_batch_p2p(_ring_ops(acc_out, acc, group, -1), group)
        if dq is None:
            dq = torch.zeros(q.shape, dtype=dt, device=q.device)
        return dq.to(q.dtype), acc[0].to(own.dtype), acc[1].to(own.dtype), None, None, None, None, None


def _arrived(pending: comm.PendingP2P, buf: torch.Tensor) -> torch.Tensor:
    pending.wait()  # the transfer overlapped the previous step's gradient math
    return buf


def _accumulate(acc: Optional[torch.Tensor], parts: list, shape: torch.Size, dt: torch.dtype,
                device: torch.device) -> torch.Tensor:
    """acc (2, b, s/cp, hk, d) or None (the block's first visit) plus this step's (key slice, dk, dv) parts,
    in place where acc exists; a single part covering every key becomes the accumulator (one stack)."""
    if acc is None and len(parts) == 1 and _covers(parts[0][0], shape[2]):
        return torch.stack([parts[0][1], parts[0][2]]).to(dt)
    if acc is None:
        acc = torch.zeros(shape, dtype=dt, device=device)
    for ks, dk_i, dv_i in parts:
        acc[0][:, ks] += dk_i
        acc[1][:, ks] += dv_i
    return acc


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group, causal: bool = True,
                   scale: Optional[float] = None, backend: str = "auto", documents: Optional[Documents] = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring attention over the CP group on load-balanced shards -> (out (b, s/cp, hq, d), lse (b, hq, s/cp)).
    documents: packed-document ids of the whole sequence (a query sees only its own document; blocks
    entirely masked for every local query are skipped and counted in documents.counters)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return RingAttention.apply(q, k, v, group, causal, scale, backend, documents)
