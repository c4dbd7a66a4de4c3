"""Prove a pipeline schedule well formed before any process runs it.

``verify(schedules, p, m, v)`` returns None or raises :class:`ScheduleError` naming the rank, the
action and what is missing. It checks, in this order (the first failure wins):

1. shape: one list per rank, microbatch < m, chunk < v, every communication action talks to the
   rank that really holds the neighbouring stage;
2. local order on each rank: every (stage, microbatch) runs its forward exactly once and its
   backward exactly once (BACKWARD, or BACKWARD_INPUT then BACKWARD_WEIGHT) on the right rank;
   a forward's input was received (or produced locally) before it; a backward comes after its
   forward and after its output gradient was received; a send comes after the compute that
   produced its tensor;
3. every send has exactly one matching receive on its peer and vice versa;
4. no deadlock: the schedule is replayed with the strict runtime model of ``schedules.py``
   (a communication group blocks until every message in it has met its partner, rendezvous
   sends), so it also cannot deadlock with any runtime that waits less;
5. FIFO: between each ordered pair of ranks, the sender lists its messages in the same order as
   the receiver, so untagged transports (NCCL) pair each send with the right receive.

Together, 2-4 give the data dependencies across ranks: stage s+1's forward of mb receives the
message that stage s sent after its forward of mb, and the replay shows that message is delivered.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Sequence

from .placement import locate, placement_for, stage_of
from .schedules import Action, ActionKind, ScheduleError
from .simulate import message_key, partner, simulate

K = ActionKind
__all__ = ["ScheduleError", "verify"]

def verify(schedules: Sequence[Sequence[Action]], p: int, m: int, v: int = 1,
           placement: str | None = None) -> None:
    """Raise :class:`ScheduleError` unless ``schedules`` is a correct, deadlock-free schedule.

    ``placement`` (``placement.py``) defaults to the one a ``Schedule`` carries, else ``loop``."""
    placement = placement_for(schedules, placement)
    if placement == "v" and v != 2:
        raise ScheduleError(f"the V placement holds two chunks per rank, got v={v}")
    if len(schedules) != p:
        raise ScheduleError(f"expected one action list per rank (p={p}), got {len(schedules)}")
    if m < 1 or v < 1:
        raise ScheduleError(f"need m >= 1 and v >= 1, got m={m}, v={v}")
    for rank, acts in enumerate(schedules):
        for a in acts:
            _check_shape(rank, a, p, m, v, placement)
    for rank, acts in enumerate(schedules):
        _check_local(rank, acts, p, m, v, placement)
    _check_matching(schedules, p, placement)
    simulate(schedules, {kind: 1 for kind in K}, placement=placement)  # ScheduleError on deadlock
    _check_fifo(schedules, p, placement)


def _check_shape(rank: int, a: Action, p: int, m: int, v: int, placement: str) -> None:
    if not isinstance(a, Action):
        raise ScheduleError(f"rank {rank}: {a!r} is not an Action")
    if a.microbatch >= m or a.chunk >= v:
        raise ScheduleError(f"rank {rank}: {a} is out of range (m={m} microbatches, v={v} chunks)")
    if a.kind.is_compute:
        return
    s, num_stages = stage_of(rank, a.chunk, p, placement), p * v
    to_next = a.kind in (K.SEND_ACT, K.RECV_GRAD)
    other = s + 1 if to_next else s - 1
    if not 0 <= other < num_stages:
        where = "last" if to_next else "first"
        raise ScheduleError(f"rank {rank}: {a} makes no sense on stage {s}, the {where} stage")
    holder = locate(other, p, placement)[0]
    if a.peer != holder or a.peer == rank:
        raise ScheduleError(f"rank {rank}: {a} names peer {a.peer}, but stage {other} "
                            f"(the {'next' if to_next else 'previous'} stage) is on rank "
                            f"{holder}" + (" (local: no message needed)" if holder == rank
                                           else ""))


def _check_local(rank: int, acts: Sequence[Action], p: int, m: int, v: int, placement: str
                 ) -> None:
    """Exactly-once and in-order checks that need only this rank's list."""
    num_stages = p * v
    done: dict[ActionKind, set[tuple[int, int]]] = defaultdict(set)

    def fail(a: Action, why: str) -> None:
        s = stage_of(rank, a.chunk, p, placement)
        raise ScheduleError(f"rank {rank}: {a} (stage {s}) {why}")

    def has(kind: ActionKind, chunk: int, mb: int) -> bool:
        return (chunk, mb) in done[kind]

    for a in acts:
        c, mb, s = a.chunk, a.microbatch, stage_of(rank, a.chunk, p, placement)
        key = (c, mb)
        bwd_in = has(K.BACKWARD, c, mb) or has(K.BACKWARD_INPUT, c, mb)
        if key in done[a.kind] or (a.kind in (K.BACKWARD, K.BACKWARD_INPUT) and bwd_in):
            fail(a, "appears more than once (each stage and microbatch must run it exactly once)")
        if a.kind is K.FORWARD and s > 0:
            prev, prev_chunk = locate(s - 1, p, placement)
            if prev == rank and not has(K.FORWARD, prev_chunk, mb):
                fail(a, f"runs before FORWARD of stage {s - 1} (same rank) produced its input")
            if prev != rank and not has(K.RECV_ACT, c, mb):
                fail(a, f"runs before its input arrived: no earlier RECV_ACT from rank {prev}")
        if a.kind in (K.BACKWARD, K.BACKWARD_INPUT):
            if not has(K.FORWARD, c, mb):
                fail(a, "runs before its FORWARD on this rank")
            if s < num_stages - 1:
                nxt, nxt_chunk = locate(s + 1, p, placement)
                if nxt == rank and not (has(K.BACKWARD, nxt_chunk, mb)
                                        or has(K.BACKWARD_INPUT, nxt_chunk, mb)):
                    fail(a, f"runs before the backward of stage {s + 1} (same rank)")
                if nxt != rank and not has(K.RECV_GRAD, c, mb):
                    fail(a, f"runs before its output gradient arrived: no earlier RECV_GRAD "
                            f"from rank {nxt}")
        if a.kind is K.BACKWARD_WEIGHT and not has(K.BACKWARD_INPUT, c, mb):
            fail(a, "runs before its BACKWARD_INPUT on this rank")
        if a.kind is K.SEND_ACT and not has(K.FORWARD, c, mb):
            fail(a, "sends an activation before its FORWARD produced it")
        if a.kind is K.SEND_GRAD and not bwd_in:
            fail(a, "sends a gradient before BACKWARD/BACKWARD_INPUT produced it")
        done[a.kind].add(key)

    for c in range(v):
        for mb in range(m):
            s = stage_of(rank, c, p, placement)
            if not has(K.FORWARD, c, mb):
                raise ScheduleError(f"rank {rank}: {Action(K.FORWARD, mb, c)} never runs "
                                    f"(stage {s}, microbatch {mb})")
            if has(K.BACKWARD_INPUT, c, mb) and not has(K.BACKWARD_WEIGHT, c, mb):
                raise ScheduleError(f"rank {rank}: {Action(K.BACKWARD_WEIGHT, mb, c)} never "
                                    f"runs after its BACKWARD_INPUT (stage {s})")
            if not (has(K.BACKWARD, c, mb) or has(K.BACKWARD_INPUT, c, mb)):
                raise ScheduleError(f"rank {rank}: {Action(K.BACKWARD, mb, c)} never runs "
                                    f"(stage {s}, microbatch {mb})")


def _check_matching(schedules: Sequence[Sequence[Action]], p: int, placement: str) -> None:
    """Every send has exactly one receive with the same message identity, and vice versa."""
    sends: Counter = Counter()
    recvs: Counter = Counter()
    first: dict[tuple, tuple[int, Action]] = {}
    for rank, acts in enumerate(schedules):
        for a in acts:
            if a.kind.is_comm:
                key = message_key(rank, a, p, placement)
                (sends if a.kind.is_send else recvs)[key] += 1
                first.setdefault((a.kind.is_send, key), (rank, a))
    for key in sorted(set(sends) | set(recvs), key=repr):
        if sends[key] != recvs[key]:
            is_send = sends[key] > recvs[key]
            rank, a = first[(is_send, key)]
            want = partner(rank, a, p, placement)
            raise ScheduleError(f"rank {rank}: {a} has no matching {want} on rank {a.peer} "
                                f"({sends[key]} send(s), {recvs[key]} receive(s) of this tensor)")


def _check_fifo(schedules: Sequence[Sequence[Action]], p: int, placement: str) -> None:
    """Per ordered pair (src, dst): the k-th send must be the k-th receive's tensor."""
    sent: dict[tuple[int, int], list[tuple[tuple, Action]]] = defaultdict(list)
    got: dict[tuple[int, int], list[tuple[tuple, Action]]] = defaultdict(list)
    for rank, acts in enumerate(schedules):
        for a in acts:
            if a.kind.is_comm:
                key = message_key(rank, a, p, placement)
                (sent if a.kind.is_send else got)[key[:2]].append((key, a))
    for (src, dst), out in sorted(sent.items()):
        for k, ((skey, sact), (rkey, ract)) in enumerate(zip(out, got[(src, dst)])):
            if skey != rkey:
                raise ScheduleError(
                    f"rank {dst}: {ract} is receive #{k} from rank {src}, but rank {src}'s send "
                    f"#{k} to rank {dst} is {sact}; messages between two ranks are matched in "
                    f"order, so both must list them in the same order")
