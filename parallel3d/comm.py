"""Collectives on explicit groups, with exact communication accounting.

Every collective takes a `Group` (never a default/global one). A group of size 1 short-circuits without
touching torch.distributed, which is what lets a world-size-1 model run as plain PyTorch.

Accounting (`CommStats`): per (group name, op) the number of calls and the bytes of the *logical*
tensor each op moves, so tests can assert Megatron's volume analysis exactly:
  all_reduce: bytes of the tensor            all_gather: bytes of the gathered (full) output
  reduce_scatter: bytes of the full input    all_to_all: bytes this rank sends (its whole input)
  send / recv: bytes of the tensor           broadcast: bytes of the tensor
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from parallel3d import gloo_collectives as gloo
from parallel3d.comm_strict import LocalWork, StrictLedger
from parallel3d.comm_simulated import (SimulatedProcessGroup, SimulatedWork, fill_all_gather,  # noqa: F401
                                       fill_all_to_all, fill_received, fill_reduce_scatter, simulated_expert_load)
from parallel3d.host_sync import HostSyncs, has_values, read_list, read_tensor, upload  # noqa: F401 (has_values)


@dataclass
class CommStats:
    """Calls and bytes per (group, op); `last_op` names the collective in flight (for hang reports)."""
    calls: dict = field(default_factory=lambda: defaultdict(int))
    bytes: dict = field(default_factory=lambda: defaultdict(int))
    last_op: str = ""
    on_op: Optional[Callable[[str], None]] = None   # e.g. the test harness's hang reporter
    listener: Optional[Callable[[str, str, int], None]] = None  # (group, op, bytes) per call: the planner
    on_wait: Optional[Callable[[int], None]] = None  # a dry run's rank waits for call `serial` (SimulatedWork)
    syncs: HostSyncs = field(default_factory=HostSyncs)  # host syncs of this rank (parallel3d.host_sync)
    serial: int = 0                                       # calls recorded so far: the last call's number
    batch: int = 0   # the number of the first call of the last call's batch (start_batch_p2p posts several
                     # sends and receives as one batch, which travel together); a lone call is its own
    strict: Optional[StrictLedger] = None   # the strict test backend's ledger (comm_strict.py), or None

    def make_strict(self) -> StrictLedger:
        """Keep NCCL's rules on this rank's groups (comm_strict.py); host reads report to the ledger."""
        self.strict = StrictLedger()
        self.syncs.on_read = self.strict.host_read
        return self.strict

    def record(self, group: "Group", op: str, nbytes: int, joins_batch: bool = False) -> None:
        key = (group.name, op)
        self.serial += 1
        if not joins_batch:
            self.batch = self.serial
        self.calls[key] += 1
        self.bytes[key] += nbytes
        self.last_op = f"{op} on {group.name} group {group.ranks}"
        if self.on_op is not None:
            self.on_op(self.last_op)
        if self.listener is not None:
            self.listener(group.name, op, nbytes)

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()
        self.syncs.reset()

    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        """{(group, op): (calls, bytes)} for every op recorded since the last reset."""
        return {k: (self.calls[k], self.bytes[k]) for k in self.calls}


@dataclass
class Group:
    """One process group as seen from this rank. `pg` is None when size == 1 (no communication).

    `device` is where this group's tensors must live (cuda for NCCL, cpu for gloo); every collective checks
    it, so a tensor on the wrong device fails here, on CPU, as it would fail under NCCL."""
    name: str
    ranks: list[int]
    global_rank: int
    pg: object = None
    stats: Optional[CommStats] = None
    device: Optional[torch.device] = None

    @property
    def simulated(self) -> bool:
        return isinstance(self.pg, SimulatedProcessGroup)

    @property
    def strict(self) -> Optional[StrictLedger]:
        """The strict test backend's ledger of this rank (comm_strict.py), or None."""
        return self.stats.strict if self.stats is not None else None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(self.global_rank)

    def _record(self, op: str, nbytes: int, joins_batch: bool = False) -> None:
        if self.stats is not None:
            self.stats.record(self, op, nbytes, joins_batch)

    def simulated_work(self, then: Optional[object] = None) -> SimulatedWork:
        """The dry-run handle of the call just recorded (SimulatedWork)."""
        return SimulatedWork(self.stats, self.stats.serial if self.stats is not None else 0, then, self.device)


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the op, group and ranks."""


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _same_device(have: torch.device, want: torch.device) -> bool:
    return have.type == want.type and (want.index is None or have.index is None or have.index == want.index)


def check_placement(group: Group, op: str, *tensors: torch.Tensor) -> None:
    """Raise CollectiveError if a tensor handed to `op` is not on the group's device (NCCL would fail)."""
    if group.device is None:
        return
    for t in tensors:
        if not _same_device(t.device, group.device):
            raise CollectiveError(f"{op} on {group.name} group (ranks {group.ranks}): tensor of shape "
                                  f"{tuple(t.shape)} is on {t.device}, the group's device is {group.device}")


def _run(group: Group, op: str, fn: Callable[[], object], *tensors: torch.Tensor, blocking: bool = False
         ) -> object:
    check_placement(group, op, *tensors)
    if group.simulated:
        return None
    if blocking and group.strict is not None:
        group.strict.blocking(group, op)
    if group.pg is None:   # (torch.distributed would take None for the default group)
        raise CollectiveError(f"{op} on {group.name} group (ranks {group.ranks}) on rank {group.global_rank}: "
                              f"it has no process group (not built, or destroyed: ParallelContext.destroy)")
    try:
        return fn()
    except RuntimeError as e:
        raise CollectiveError(f"{op} on {group.name} group (ranks {group.ranks}) failed on rank "
                              f"{group.global_rank}: {e}") from e


_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce(t: torch.Tensor, group: Group, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce; returns t."""
    if group.size == 1:
        return t
    group._record("all_reduce", _nbytes(t))
    _run(group, "all_reduce", lambda: dist.all_reduce(t, op=_OPS[op], group=group.pg), t, blocking=True)
    return t


def _all_gather_single() -> Callable:
    """torch 2.13 named the single-tensor collectives *_single (the *_tensor names now warn); setup.py also
    allows older torch, which has only the old names (the 2026-11 GPU image runs 2.11). Looked up per call,
    so a test harness that wraps torch.distributed's functions sees the call."""
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_single() -> Callable:
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's t along dim (all ranks' shapes equal)."""
    if group.size == 1:
        return t
    src = t.movedim(dim, 0).contiguous()  # gather along dim 0, then move the axis back
    out = torch.empty((group.size * src.shape[0],) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    wait_work(start_all_gather(out, src, group), group, "all_gather")
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def reduce_scatter(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum over ranks, then keep this rank's 1/size slice along dim (dim size divisible by group size)."""
    if group.size == 1:
        return t
    if t.shape[dim] % group.size:
        raise ValueError(f"reduce_scatter on {group.name}: dim {dim} of size {t.shape[dim]} is not "
                         f"divisible by the group size {group.size}")
    src = t.movedim(dim, 0).contiguous() if dim != 0 else t.contiguous()
    out = torch.empty((src.shape[0] // group.size,) + tuple(src.shape[1:]), dtype=t.dtype, device=t.device)
    wait_work(start_reduce_scatter(out.view(-1), src.view(-1), group), group, "reduce_scatter")
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def all_to_all(t: torch.Tensor, group: Group, out_splits: Optional[Sequence[int]] = None,
               in_splits: Optional[Sequence[int]] = None) -> torch.Tensor:
    """All-to-all along dim 0 with (possibly uneven) splits. Equal splits when both are None."""
    if group.size == 1:
        return t
    t = t.contiguous()
    if out_splits is None:
        out = torch.empty_like(t)
    else:
        out = torch.empty((sum(out_splits),) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    group._record("all_to_all", _nbytes(t))
    _run(group, "all_to_all", lambda: dist.all_to_all_single(
        out, t, None if out_splits is None else list(out_splits),
        None if in_splits is None else list(in_splits), group=group.pg), t, blocking=True)
    if group.simulated:
        fill_all_to_all(out, t)
    return out


def broadcast(t: torch.Tensor, group: Group, src: int = 0) -> torch.Tensor:
    """In-place broadcast from the group-local rank `src`."""
    if group.size == 1:
        return t
    group._record("broadcast", _nbytes(t))
    _run(group, "broadcast", lambda: dist.broadcast(t, group.ranks[src], group=group.pg), t, blocking=True)
    return t


@dataclass
class P2P:
    """One point-to-point op for `batch_p2p`: op is 'send' or 'recv'; peer is a global rank."""
    op: str
    tensor: torch.Tensor
    peer: int


# ---- asynchronous collectives (bucketed gradient reduction, ZeRO-3 prefetch) -------------------------
# Same accounting as the blocking ones. Every start returns a work handle to `wait_work` before the output
# is read, whatever the group: a group of size 1 moves and records nothing but still hands back a
# LocalWork (comm_strict.py), so a caller on another stream orders itself after the copy that wrote it.

def _started(group: Group, op: str, launch: Callable[[list, list], object], outputs: list, inputs: list) -> object:
    """launch(outputs, inputs) -> its handle; under the strict backend into private copies (comm_strict)."""
    if group.strict is None or group.simulated:
        return launch(outputs, inputs)
    return group.strict.start(group, op, launch, outputs, inputs)


def local_work(group: Group, op: str, outputs: Sequence[torch.Tensor],
               write: Optional[Callable[[], object]] = None) -> object:
    """The handle of a result this rank writes itself, now, on the current stream (`write` writes
    `outputs`): a size-1 group's copy, or a blocking path (qgZ, compression) that has already run. Under
    the strict backend the outputs are hidden (NaN) until the handle is waited, as any started collective's."""
    if write is not None:
        write()
    device = outputs[0].device if outputs else torch.device("cpu")
    if group.strict is None:
        return LocalWork(device)
    return group.strict.start(group, op, lambda outs, ins: LocalWork(device), list(outputs), [])


def start_all_reduce(t: torch.Tensor, group: Group) -> object:
    """In-place sum over the group; returns the work handle to `wait_work`."""
    if group.size == 1:
        return local_work(group, "all_reduce", [t])
    group._record("all_reduce", _nbytes(t))

    def launch(outs: list, _: list) -> object:
        work = _run(group, "all_reduce", lambda: dist.all_reduce(outs[0], op=dist.ReduceOp.SUM, group=group.pg,
                                                                 async_op=True), outs[0])
        return group.simulated_work() if group.simulated else work
    return _started(group, "all_reduce", launch, [t], [t])


def on_gloo(group: Group) -> bool:
    """Whether the group's collectives run on gloo (parallel3d/gloo_collectives.py's reduce-scatter and
    all-gather replace gloo's own), or stand in for gloo's in a dry run."""
    if group.simulated:
        return group.pg.backend == "gloo"
    return group.pg is not None and dist.get_backend(group.pg) == "gloo"


def start_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Group) -> object:
    """out (n,) <- this rank's n-element block of the sum over ranks of inp (size * n,)."""
    if group.size == 1:
        return local_work(group, "reduce_scatter", [out], lambda: out.copy_(inp))
    group._record("reduce_scatter", _nbytes(inp))
    if group.simulated:
        check_placement(group, "reduce_scatter", out, inp)
        if on_gloo(group):   # the all-to-all's receive buffer and the sum on wait, as on gloo
            return group.simulated_work(gloo.simulate_reduce_scatter(out, inp, group.size, group.rank))
        fill_reduce_scatter(out, inp, group.rank)
        return group.simulated_work()

    def launch(outs: list, ins: list) -> object:
        if on_gloo(group):   # an all-to-all and a sum on wait (gloo_collectives.py)
            return _run(group, "reduce_scatter", lambda: gloo.start_reduce_scatter(outs[0], ins[0], group.pg,
                                                                                    group.size), outs[0], ins[0])
        return _run(group, "reduce_scatter", lambda: _reduce_scatter_single()(outs[0], ins[0], group=group.pg,
                                                                              async_op=True), outs[0], ins[0])
    return _started(group, "reduce_scatter", launch, [out], [inp])


def start_all_gather(out: torch.Tensor, inp: torch.Tensor, group: Group) -> object:
    """out (size * n,) <- every rank's inp (n,), in group-rank order; inp may be this rank's block of out."""
    if group.size == 1:
        return local_work(group, "all_gather", [out], None if torch._C._is_alias_of(inp, out) else
                          lambda: out.copy_(inp))
    group._record("all_gather", _nbytes(out))
    if group.simulated:
        check_placement(group, "all_gather", out, inp)
        if on_gloo(group):   # the local copy as on gloo, the peers' blocks filled by the stand-in
            fill_all_gather(out, gloo.own_block(out, inp, group.size, group.rank), group.size)
        else:
            fill_all_gather(out, inp, group.size)
        return group.simulated_work()

    def launch(outs: list, ins: list) -> object:
        if on_gloo(group):   # (direct sends need no memory the simulation lacks)
            return _run(group, "all_gather", lambda: gloo.start_all_gather(outs[0], ins[0], group.pg, group.ranks,
                                                                            group.rank), outs[0], ins[0])
        return _run(group, "all_gather", lambda: _all_gather_single()(outs[0], ins[0], group=group.pg,
                                                                      async_op=True), outs[0], ins[0])
    return _started(group, "all_gather", launch, [out], [inp])


def start_all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Group, out_splits: Sequence[int],
                     in_splits: Sequence[int]) -> object:
    """out (sum(out_splits), ...) <- the rows every rank sends this one, inp (sum(in_splits), ...) split over the
    ranks; started, returns the work handle (the MoE exchange's overlapped path: interleave.py)."""
    if group.size == 1:
        return local_work(group, "all_to_all", [out], lambda: out.copy_(inp))
    group._record("all_to_all", _nbytes(inp))
    if group.simulated:
        check_placement(group, "all_to_all", out, inp)
        fill_all_to_all(out, inp)
        return group.simulated_work()

    def launch(outs: list, ins: list) -> object:
        return _run(group, "all_to_all", lambda: dist.all_to_all_single(
            outs[0], ins[0], list(out_splits), list(in_splits), group=group.pg, async_op=True), outs[0], ins[0])
    return _started(group, "all_to_all", launch, [out], [inp])


def orders_on_device(group: Group) -> bool:
    """Whether waiting for this group's work orders the device instead of blocking the host: NCCL's
    work.wait() makes the current CUDA stream wait for the collective, so what follows a collective can be
    queued right after it and runs when it is done. gloo's wait() blocks the calling thread (and the
    simulated backend's dry run has no work), so follow-ups there wait for `is_completed()` polls instead. A
    simulated rank standing for NCCL on a real GPU (pretrain.py --simulate-rank) orders it as NCCL does
    (comm_simulated.SimulatedWork), so its side streams run as a real rank's. The strict test backend
    (comm_strict.py) answers as NCCL, so gloo runs NCCL's paths."""
    if group.simulated:
        return group.pg.backend == "nccl" and group.device is not None and group.device.type == "cuda"
    if group.pg is None:
        return False
    return dist.get_backend(group.pg) == "nccl" or group.strict is not None


def wait_work(work: object, group: Group, op: str) -> None:
    """Wait for a handle from a start_* call before reading its output (on CUDA: order the current stream
    after the stream that wrote it; comm_strict.py owns the rule); a failure or timeout names the op and the
    group."""
    if work is None:
        raise CollectiveError(f"{op} on {group.name} group (ranks {group.ranks}): no work handle to wait for "
                              f"(every comm.start_* returns one)")
    if group.simulated or group.pg is None:
        work.wait()   # SimulatedWork (the stand-in's sum on wait, the planner's wait mark) or a local result
    else:
        _run(group, op, work.wait)


@dataclass
class PendingP2P:
    """Sends and receives in flight; `wait()` before reading the received buffers (or reusing sent ones)."""
    group: Group
    works: list
    tensors: list  # kept alive until the transfers finish
    # a dry run's SimulatedWork per op, waited with the batch: `works` stays empty there, as a coalesced
    # batch's (the pipeline's P2PQueue then waits it at once and frees sent outputs as NCCL's run does)
    simulated: list = field(default_factory=list)

    def wait(self) -> None:
        for w in self.works:
            wait_work(w, self.group, "batch_p2p wait")
        for w in self.simulated:
            w.wait()
        self.works, self.tensors, self.simulated = [], [], []


def start_batch_p2p(ops: Sequence[P2P], group: Group) -> PendingP2P:
    """Post sends and receives together (batch_isend_irecv) and return at once, so the caller can compute
    while they travel (ring attention overlaps the next K/V block's transfer with this block's math)."""
    if group.simulated:   # a simulated rank with values: no peer writes its receives (comm_simulated); filled
        for o in ops:     # before the handles, which (on CUDA) order the device after the fills
            if o.op == "recv" and has_values(o.tensor):
                fill_received(o.tensor, group.pg.generator(o.tensor.device))
    p2p_ops, simulated = [], []
    for i, o in enumerate(ops):
        group._record(o.op, _nbytes(o.tensor), joins_batch=i > 0)
        if group.simulated:
            simulated.append(group.simulated_work())
        else:
            fn = dist.isend if o.op == "send" else dist.irecv
            p2p_ops.append(dist.P2POp(fn, o.tensor, o.peer, group=group.pg))
    works = _run(group, "batch_p2p", lambda: dist.batch_isend_irecv(p2p_ops), *(o.tensor for o in ops)) if ops else []
    return PendingP2P(group, list(works or []), [o.tensor for o in ops], simulated)


def batch_p2p(ops: Sequence[P2P], group: Group) -> None:
    """Issue sends and receives together (batch_isend_irecv) and wait for all of them."""
    start_batch_p2p(ops, group).wait()


def barrier(group: Group) -> None:
    if group.size == 1:
        return
    group._record("barrier", 0)
    _run(group, "barrier", lambda: dist.barrier(group=group.pg), blocking=True)


def transfer_stand_ins() -> tuple:
    """The functions by which a dry run fills a collective's output in place of the network (the
    simulated backend): their copies are the transfer's own work, which the collective's price covers, so
    the planner's tracker does not price them as compute. Not among them: gloo's sum on wait (real
    arithmetic, run as on gloo)."""
    return (fill_reduce_scatter, fill_all_gather, fill_all_to_all, fill_received, gloo.simulate_reduce_scatter)


# ---- reading device values on the host: parallel3d.host_sync (read_float, read_list, read_tensor), counted

def even_split(total: int, parts: int) -> list[int]:
    """`total` items over `parts` as evenly as possible (the dry run's balanced routing)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def all_gather_varlen(data: torch.Tensor, group: Group, device: torch.device, category: str = "logging"
                      ) -> list[torch.Tensor]:
    """All-gather 1-D tensors of different lengths: lengths first, then the payloads padded to the longest.
    Two host syncs (the lengths, the payloads), counted under `category` (parallel3d.host_sync)."""
    if group.size == 1:
        return [data]
    syncs = group.stats.syncs if group.stats is not None else None
    length = torch.full((1,), data.numel(), dtype=torch.int64, device=device)
    lengths = read_list(all_gather(length, group), syncs, category, [data.numel()] * group.size)
    padded = torch.zeros(max(max(lengths), 1), dtype=data.dtype, device=device)
    padded[: data.numel()] = upload(data, device)
    everyone = read_tensor(all_gather(padded, group).view(group.size, -1), syncs, category)  # on the host
    return [everyone[r, :n] for r, n in enumerate(lengths)]


def all_gather_json(obj: object, group: Group, device: Optional[torch.device] = None, category: str = "logging"
                    ) -> list:
    """Every rank's JSON-able `obj`, in group-rank order (size 1: `[obj]`, no communication). JSON travels
    as uint8 tensors on `device` (NCCL needs device tensors): no pickle, no object collectives."""
    import json

    if group.size == 1:
        return [obj]
    device = device or group.device or torch.device("cpu")
    raw = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)
    return [json.loads(bytes(t.tolist()).decode()) for t in all_gather_varlen(raw, group, device, category)]


class _AllToAll(torch.autograd.Function):
    """Differentiable all-to-all: the backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return all_to_all(x, group, out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad):
        return all_to_all(grad.contiguous(), ctx.group, ctx.in_splits, ctx.out_splits), None, None, None


def all_to_all_autograd(x: torch.Tensor, group: Group, out_splits: Optional[Sequence[int]] = None,
                        in_splits: Optional[Sequence[int]] = None) -> torch.Tensor:
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group, out_splits, in_splits)
