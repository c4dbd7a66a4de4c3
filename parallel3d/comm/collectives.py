"""The collectives: blocking ones, and started ones that return a work handle for `wait_work`."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from parallel3d.comm import gloo
from parallel3d.comm.group import CollectiveError, Group, _nbytes, _run, check_placement
from parallel3d.comm.simulated import fill_all_gather, fill_all_to_all, fill_reduce_scatter
from parallel3d.comm.strict import LocalWork


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


def barrier(group: Group) -> None:
    if group.size == 1:
        return
    group._record("barrier", 0)
    _run(group, "barrier", lambda: dist.barrier(group=group.pg), blocking=True)


# ---- asynchronous collectives (bucketed gradient reduction, ZeRO-3 prefetch) -------------------------
# Same accounting as the blocking ones. Every start returns a work handle to `wait_work` before the output
# is read, whatever the group: a group of size 1 moves and records nothing but still hands back a
# LocalWork (comm/strict.py), so a caller on another stream orders itself after the copy that wrote it.

def _started(group: Group, op: str, launch: Callable[[list, list], object], outputs: list, inputs: list) -> object:
    """launch(outputs, inputs) -> its handle; under the strict backend into private copies (comm/strict.py)."""
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
    """Whether the group's collectives run on gloo (parallel3d/comm/gloo.py's reduce-scatter and
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
        if on_gloo(group):   # an all-to-all and a sum on wait (comm/gloo.py)
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
    (comm.simulated.SimulatedWork), so its side streams run as a real rank's. The strict test backend
    (comm/strict.py) answers as NCCL, so gloo runs NCCL's paths."""
    if group.simulated:
        return group.pg.backend == "nccl" and group.device is not None and group.device.type == "cuda"
    if group.pg is None:
        return False
    return dist.get_backend(group.pg) == "nccl" or group.strict is not None


def wait_work(work: object, group: Group, op: str) -> None:
    """Wait for a handle from a start_* call before reading its output (on CUDA: order the current stream
    after the stream that wrote it; comm/strict.py owns the rule); a failure or timeout names the op and the
    group."""
    if work is None:
        raise CollectiveError(f"{op} on {group.name} group (ranks {group.ranks}): no work handle to wait for "
                              f"(every comm.start_* returns one)")
    if group.simulated or group.pg is None:
        work.wait()   # SimulatedWork (the stand-in's sum on wait, the planner's wait mark) or a local result
    else:
        _run(group, op, work.wait)
