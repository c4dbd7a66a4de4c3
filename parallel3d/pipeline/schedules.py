"""Pipeline schedules as data: one list of :class:`Action` per pipeline rank.

A schedule is a pure function ``(p, m[, v]) -> list[list[Action]]``. Nothing here touches torch;
the verifier (``verify.py``) proves a schedule well formed, the simulator (``simulate.py``) turns it
into a timeline, and the runtime executes it. This module docstring is the contract between them.

Stages. With ``p`` ranks and ``v`` model chunks per rank there are ``S = v * p`` global stages.
Which rank holds which stage is the schedule's *placement* (``placement.py``): chunk ``c`` on rank
``r`` is stage ``c * p + r`` (``loop``, Megatron's interleaved layout, used by the schedules in this
file), or, for ZB-V and DualPipe-V (``vshape.py``), stage ``r`` and ``2p - 1 - r`` (``v``)::

    loop, p=2, v=2:   rank 0 holds stages 0, 2      rank 1 holds stages 1, 3
    v,    p=2:        rank 0 holds stages 0, 3      rank 1 holds stages 1, 2

A schedule on another placement than ``loop`` is a :class:`placement.Schedule` (a list that carries
its placement), which the verifier, simulator and runtime read.

Every action names the *local* chunk it serves, so a runtime on rank ``r`` indexes its own
list of model chunks with ``action.chunk`` and never needs global stage arithmetic:

=================  =========================================================================
FORWARD            run chunk ``c`` forward on microbatch ``mb`` (stage 0 reads the data
                   loader; other stages read the tensor a RECV_ACT stored, or, when the
                   previous stage is on this same rank, that stage's output directly)
BACKWARD           full backward of (mb, c): input grads and weight grads together
BACKWARD_INPUT     only the gradient w.r.t. the chunk's input (what the previous stage waits
                   for); frees most of the activation memory
BACKWARD_WEIGHT    only the weight gradients of (mb, c); must follow its BACKWARD_INPUT on the
                   same rank. The last stage's backward starts from the loss.
SEND_ACT   -> peer the output activation of FORWARD(mb, c) to the rank of the next stage
RECV_ACT   <- peer the input activation of (mb, c) from the rank of the previous stage
SEND_GRAD  -> peer the gradient w.r.t. the input of (mb, c) (made by BACKWARD[_INPUT])
RECV_GRAD  <- peer the gradient w.r.t. the output of (mb, c) from the rank of the next stage
=================  =========================================================================

Communication convention (what the runtime must do, and what the verifier proves safe):

1. Each rank executes its list in order.
2. A maximal run of consecutive communication actions is ONE group: post all of them at once
   (``torch.distributed.batch_isend_irecv``, P2POps in list order) and wait for all of them before
   the next compute action. The verifier proves this cannot deadlock even if every send blocks
   until its receive is posted. A runtime may wait less (only for the group's receives, finishing
   sends before their buffers are reused or at the end of the step): that is safe as well, and
   ``simulate(..., lazy_sends=True)`` models it. Where every op completes by itself (gloo), a
   runtime may also post a group's receives earlier, in their per-peer order, and wait for each
   only when its tensor is read (``runtime_schedules.rank_plan``): every rank then gets at least
   as far as in the model. With lazy sends a send may likewise be posted earlier, right after the
   compute that produced it, keeping its order among the sends to the same peer (DualPipe-V's
   pairs; ``posting.sends_early``). Posting a group's actions one by one with blocking calls is NOT safe.
3. Messages between an ordered pair of ranks are matched first-in first-out: the k-th send from
   ``a`` to ``b`` pairs with the k-th receive on ``b`` from ``a`` (NCCL has no tags). The verifier
   checks that both sides list the same messages in the same order, so no tags are needed.
4. A group holds the sends of what the computes before it produced and the receives of what the
   computes after it consume, so a send and the next receive travel together (Megatron's
   ``send_forward_recv_backward``). Some schedules run several computes between groups
   (interleaved 1F1B's ``F B``, ZB-H1's ``I W``) so that both ends of each message are posted
   at the same moment and blocking groups never wait for a busy peer.

With ``p == 1`` (or for stage pairs on the same rank) there is no communication at all.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from .actions import Action, ActionKind, ScheduleError  # noqa: F401  (re-exported)
from .placement import V_SCHEDULES, schedule_key, stage_of  # noqa: F401  (stage_of re-exported)
from .vshape import dualpipe_v, zb_v


def _check_pm(p: int, m: int) -> None:
    if not isinstance(p, int) or p < 1:
        raise ValueError(f"pipeline size p must be an integer >= 1, got {p!r}")
    if not isinstance(m, int) or m < 1:
        raise ValueError(f"number of microbatches m must be an integer >= 1, got {m!r}")


# A compute order is a list of (kind, global stage, microbatch); a rank's program is a list of
# segments (compute orders) and _lower puts one communication group between consecutive segments.
_Order = list[tuple[ActionKind, int, int]]


def _lower(p: int, num_stages: int, programs: Sequence[Sequence[_Order]]) -> list[list[Action]]:
    """Turn per-rank segments of compute into actions with one comm group between segments.

    The group before a segment holds the sends of everything the previous segment produced and the
    receives of everything the segment consumes (rule 4). Segments of one action give the usual
    send-after-produce / receive-before-consume; longer segments (interleaved 1F1B's ``[F, B]``)
    make both ends of a message meet in groups that are posted at the same time.
    """
    out: list[list[Action]] = []
    for rank, segments in enumerate(programs):
        acts: list[Action] = []
        for seg in segments:
            for kind, s, mb in seg:  # receives for this segment
                if kind is ActionKind.FORWARD and s > 0 and (s - 1) % p != rank:
                    acts.append(Action(ActionKind.RECV_ACT, mb, s // p, (s - 1) % p))
                if kind in _BWD_IN and s < num_stages - 1 and (s + 1) % p != rank:
                    acts.append(Action(ActionKind.RECV_GRAD, mb, s // p, (s + 1) % p))
            acts += [Action(kind, mb, s // p) for kind, s, mb in seg]
            for kind, s, mb in seg:  # sends of what it produced
                if kind is ActionKind.FORWARD and s < num_stages - 1 and (s + 1) % p != rank:
                    acts.append(Action(ActionKind.SEND_ACT, mb, s // p, (s + 1) % p))
                if kind in _BWD_IN and s > 0 and (s - 1) % p != rank:
                    acts.append(Action(ActionKind.SEND_GRAD, mb, s // p, (s - 1) % p))
        out.append(acts)
    return out


_BWD_IN = (ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT)


def _singletons(order: _Order) -> list[_Order]:
    return [[op] for op in order]


def gpipe(p: int, m: int) -> list[list[Action]]:
    """GPipe: every rank runs all m forwards, then all m backwards (same microbatch order).

    Simple, but rank 0 holds the activations of all ``m`` microbatches at once. p=3, m=4, F=B=1
    (bubble ``(p-1)/(m+p-1)`` of the time, as for 1F1B)::

        rank 0: F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3
        rank 1: .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .
        rank 2: .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .
    """
    _check_pm(p, m)
    f, b = ActionKind.FORWARD, ActionKind.BACKWARD
    orders = [[(f, r, i) for i in range(m)] + [(b, r, i) for i in range(m)] for r in range(p)]
    return _lower(p, p, [_singletons(o) for o in orders])


def _one_f_one_b_order(p: int, m: int, rank: int, bwd: ActionKind) -> _Order:
    warmup = min(p - rank - 1, m)
    order: _Order = [(ActionKind.FORWARD, rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [(ActionKind.FORWARD, rank, warmup + i), (bwd, rank, i)]
    order += [(bwd, rank, i) for i in range(m - warmup, m)]
    return order


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush / Megatron): ``p - r - 1`` warm-up forwards, then alternate.

    Same bubble as GPipe, but rank ``r`` never holds more than ``min(p - r, m)`` microbatches.
    p=3, m=4, F=B=1, and the lowered list of rank 1 (``[...]`` = one communication group)::

        rank 0: F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
        rank 1: .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
        rank 2: .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .

        rank 1: [ra0<0] F0 [sa0>2 ra1<0] F1 [sa1>2 rg0<2] B0 [sg0>0 ra2<0] F2 [sa2>2 rg1<2] B1 ...
    """
    _check_pm(p, m)
    return _lower(p, p, [_singletons(_one_f_one_b_order(p, m, r, ActionKind.BACKWARD))
                         for r in range(p)])


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021): v chunks per rank shrink the bubble v-fold.

    Microbatches go through in groups of ``p``: a rank runs chunk 0 for microbatches 0..p-1, then
    chunk 1 for the same group, ..., then chunk 0 for the next group. Backwards walk the chunks
    in reverse. Rank ``r`` warms up with ``2 (p - r - 1) + (v - 1) p`` forwards (capped at
    ``m v``), then alternates forward/backward. The classic form needs ``m % p == 0`` so that stage
    ``c p`` on rank 0 finds the output of stage ``c p - 1`` ready when its turn comes.

    Communication follows Megatron: in the steady phase a rank runs ``F`` and ``B`` back to back
    and then exchanges everything in one group (both outputs out, both next inputs in). With
    chunk costs ``1/v`` of a full stage the bubble is ``(p-1)/(v m + p-1)``. p=2, m=4, v=2,
    F=1/2, B=1 (cells of 1/2; ``F2`` is microbatch 2 on either chunk)::

        rank 0: F0 F1 F0 F1 .  .  F2 B0 B0 F3 B1 B1 F2 B0 B0 F3 B1 B1 B2 B2 .  B3 B3 B2 B2 B3 B3
        rank 1: .  F0 F1 F0 B0 B0 F1 B1 B1 F2 B0 B0 F3 B1 B1 F2 B2 B2 F3 B3 B3 B2 B2 B3 B3 .  .
    """
    _check_pm(p, m)
    if not isinstance(v, int) or v < 2:
        raise ValueError(f"interleaved 1F1B needs v >= 2 virtual chunks per rank, got v={v!r} "
                         "(use '1f1b' for v=1)")
    if m % p:
        raise ValueError(f"interleaved 1F1B needs the number of microbatches (m={m}) to be a "
                         f"multiple of the pipeline size (p={p})")
    total = m * v

    def unit(k: int, rank: int, forward: bool) -> tuple[int, int]:
        group, pos = divmod(k, p * v)
        chunk = pos // p if forward else v - 1 - pos // p
        return stage_of(rank, chunk, p), group * p + pos % p

    programs: list[list[_Order]] = []
    for r in range(p):
        f = [(ActionKind.FORWARD, *unit(k, r, True)) for k in range(total)]
        b = [(ActionKind.BACKWARD, *unit(k, r, False)) for k in range(total)]
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        segments = [[op] for op in f[:warmup]]
        segments += [[f[warmup + k], b[k]] for k in range(total - warmup)]
        programs.append(segments + [[op] for op in b[total - warmup:]])
    return _lower(p, p * v, programs)


def zb_h1(p: int, m: int) -> list[list[Action]]:
    """Zero-bubble ZB-H1 (Qi et al. 2023): 1F1B with backward split into input and weight grads.

    Each rank keeps 1F1B's order of forwards and BACKWARD_INPUTs (``I``), so the same number of
    microbatches waits for its input gradient, and rank ``r`` runs BACKWARD_WEIGHT (``W``) of
    microbatch ``k`` right after ``I`` of ``k + r``. Later ranks thus bank up to ``r`` weight passes
    and spend them in the cool-down, where 1F1B idles while the last input gradients travel back
    to rank 0. No rank holds more than ``min(p, m)`` microbatches of activations (1F1B's peak,
    on rank 0). With F = I = W = 1 and m >= p the makespan is ``3m + p - 1``: a bubble of ``p - 1``
    per rank instead of 1F1B's ``3 (p - 1)``. p=4, m=8::

        rank 0: F0 F1 F2 F3 .  .  .  I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7
        rank 3: .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7

    Communication: when a ``W`` sits between an ``I`` and the next forward, the ``I``'s gradient
    send waits until after the ``W`` and shares a group with that forward's receive; that is the
    moment the previous rank posts its matching receive, so blocking groups never stall.
    """
    _check_pm(p, m)
    inp, wgt = ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT
    programs: list[list[_Order]] = []
    for r in range(p):
        order: _Order = []
        n_inputs = 0
        for op in _one_f_one_b_order(p, m, r, inp):
            order.append(op)
            if op[0] is inp:
                if n_inputs >= r:
                    order.append((wgt, r, n_inputs - r))
                n_inputs += 1
        order += [(wgt, r, k) for k in range(max(0, m - r), m)]
        segments: list[_Order] = []
        for i, op in enumerate(order):
            after = next((o[0] for o in order[i + 1:] if o[0] is not wgt), None)
            if op[0] is wgt and segments and after is ActionKind.FORWARD:
                segments[-1].append(op)
            else:
                segments.append([op])
        programs.append(segments)
    return _lower(p, p, programs)


SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v")
# schedules whose backward runs as an input-gradient pass and a later weight-gradient pass
SPLIT_BACKWARD = frozenset({"zb-h1", "zb-v", "dualpipe-v"})


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Schedule by config name (``parallel.schedule``): gpipe, 1f1b, interleaved, zb-h1, zb-v,
    dualpipe-v. ``v`` is the number of chunks per rank (``placement.chunks_per_rank``): the
    V-shaped schedules need ``v=2`` and return a ``placement.Schedule`` on the V placement."""
    key = schedule_key(name)
    if key == "interleaved":
        return interleaved_1f1b(p, m, v)
    if key not in SCHEDULE_NAMES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {SCHEDULE_NAMES}")
    if key in V_SCHEDULES:
        if v != 2:
            raise ValueError(f"schedule {name!r} runs two model chunks per rank placed in a V; got "
                             f"v={v} chunks (placement.chunks_per_rank gives 2)")
        return {"zb-v": zb_v, "dualpipe-v": dualpipe_v}[key](p, m)
    if v != 1:
        raise ValueError(f"schedule {name!r} runs one model chunk per rank; got v={v} "
                         "(use 'interleaved' for virtual stages)")
    return {"gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}[key](p, m)


def format_schedule(schedules: Sequence[Iterable[Action]], comm: bool = True) -> str:
    """One row per rank; ``[...]`` marks a communication group posted together (rule 2).

    ``F``/``B``/``I``/``W`` = forward / full backward / input grad / weight grad, the number is the
    microbatch, ``c1`` the local chunk (shown when any action uses a chunk > 0),
    ``sa``/``ra``/``sg``/``rg`` = send/recv activation/gradient, ``>2`` / ``<2`` the peer rank.
    """
    rows = [list(acts) for acts in schedules]
    with_chunk = any(a.chunk > 0 for row in rows for a in row)
    lines = []
    for rank, row in enumerate(rows):
        tokens: list[str] = []
        group: list[str] = []
        for act in row + [None]:
            if act is not None and act.kind.is_comm:
                group.append(act.short(with_chunk))
                continue
            if group and comm:
                tokens.append("[" + " ".join(group) + "]")
            group = []
            if act is not None:
                tokens.append(act.short(with_chunk))
        lines.append(f"rank {rank}: " + " ".join(tokens))
    return "\n".join(lines)
