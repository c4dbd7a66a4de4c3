"""Bus bandwidth of a group's collectives, measured through parallel3d.comm, beside the planner's figure.

NCCL-tests' convention: the algorithm bandwidth is the bytes of the op over its time, with the bytes comm's
accounting records (all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the full input;
all-to-all: what a rank sends; p2p: the tensor), and the bus bandwidth scales it by what each link must carry
for the op, so one figure compares with the link's speed whatever the group size n:

    all_reduce                            busbw = algbw * 2 (n - 1) / n
    all_gather, reduce_scatter, all_to_all busbw = algbw * (n - 1) / n
    p2p (one send to the next stage)      busbw = algbw

The planner's figure is the same bus bandwidth computed from its own time for that op and size
(planner/cost.collective_seconds: the link's latency and bandwidth for those ranks on that GPU, NVLink
inside a node, the network across nodes; on a CPU, this machine's profiled gloo figures when a profile is
cached, else none). Timings are printed, never asserted.
"""
from __future__ import annotations

import json
import time
from typing import Optional

import torch

from parallel3d import comm
from parallel3d.mesh import ParallelContext

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
RECORDED = {"p2p": "send"}   # comm's accounting name of an op, where it differs


def bus_factor(op: str, n: int) -> float:
    """NCCL-tests' bus-bandwidth factor of `op` over `n` ranks (module docstring)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if op == "p2p":
        return 1.0
    raise ValueError(f"no bus-bandwidth factor for {op}")


def _issue(op: str, group: comm.Group, buf: torch.Tensor, out: torch.Tensor) -> None:
    """One `op` of `buf` on `group`, waited for (p2p: group rank 0 sends to group rank 1)."""
    if op == "all_reduce":
        comm.wait_work(comm.start_all_reduce(buf, group), group, op)
    elif op == "all_gather":   # buf: this rank's block; out: the gathered (n x) tensor
        comm.wait_work(comm.start_all_gather(out, buf, group), group, op)
    elif op == "reduce_scatter":   # buf: the full input; out: this rank's block
        comm.wait_work(comm.start_reduce_scatter(out, buf, group), group, op)
    elif op == "all_to_all":
        comm.all_to_all(buf, group)
    elif op == "p2p" and group.rank < 2:
        peer = group.ranks[1 - group.rank]
        comm.batch_p2p([comm.P2P("send" if group.rank == 0 else "recv", buf, peer)], group)


def _buffers(op: str, group: comm.Group, nbytes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 buffers for an op whose accounted size is about `nbytes` (a multiple of the group size)."""
    n = group.size
    elems = max(n, nbytes // 4 // n * n)
    if op == "all_gather":
        return torch.ones(elems // n, device=device), torch.empty(elems, device=device)
    if op == "reduce_scatter":
        return torch.ones(elems, device=device), torch.empty(elems // n, device=device)
    return torch.ones(elems, device=device), torch.empty(0, device=device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(ctx: ParallelContext, dim: str, op: str, nbytes: int, iters: int) -> dict:
    """Time `iters` of `op` on this rank's `dim` group (after one warm-up), every rank at once; returns the
    slowest rank's figures (the same dict on every rank). Every rank of the world must call it."""
    group = getattr(ctx, dim)
    device = ctx.device
    buf, out = _buffers(op, group, nbytes, device)
    _issue(op, group, buf, out)                      # warm-up: connections, algorithm choice
    key = (group.name, RECORDED.get(op, op))
    before = ctx.stats.bytes.get(key, 0)
    _sync(device)
    comm.barrier(ctx.world)
    start = time.perf_counter()
    for _ in range(iters):
        _issue(op, group, buf, out)
    _sync(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    moved = (ctx.stats.bytes.get(key, 0) - before) // iters
    # the slowest group's time, and the bytes of a rank that moved any (p2p: the sender)
    stats = torch.tensor([float(moved)], dtype=torch.float64, device=device)
    comm.all_reduce(elapsed, ctx.world, op="max")
    comm.all_reduce(stats, ctx.world, op="max")
    seconds, moved = float(elapsed.item()), int(stats.item())
    algbw = moved / seconds if seconds > 0 else 0.0
    return {"group": dim, "op": op, "ranks": list(group.ranks), "size": group.size, "bytes": moved,
            "seconds": seconds, "busbw": algbw * bus_factor(op, group.size) if group.size > 1 else 0.0}


def planner_device(device: torch.device, world: int) -> tuple[Optional[object], str]:
    """(the planner's GPU for this machine or None, its name or why there is none). On a CPU only a cached
    profile is read (planner/profile.py): measuring one takes minutes (launch/plan.py --gpu cpu does it)."""
    from parallel3d.planner import profile
    from parallel3d.planner.hardware import gpu_of_device

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        try:
            found = gpu_of_device(name)
        except ValueError as e:
            return None, str(e)
        return found, found.name
    path = profile.cache_path()
    try:
        cached = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        cached = {}
    if cached.get("version") != profile.VERSION or str(world) not in cached.get("gloo", {}):
        return None, f"no CPU profile for {world} ranks cached (launch/plan.py --gpu cpu --world-size {world})"
    found = profile.cpu_device(world)
    return found, found.name


def planner_busbw(row: dict, gpu, gpus_per_node: int) -> Optional[float]:
    """The planner's bus bandwidth for a measured row: its seconds for that op and size on those ranks."""
    from parallel3d.planner.cost import collective_seconds

    if gpu is None or row["size"] < 2 or not row["bytes"]:
        return None
    seconds = collective_seconds(RECORDED.get(row["op"], row["op"]), row["bytes"], row["ranks"], gpus_per_node, gpu)
    return row["bytes"] / seconds * bus_factor(row["op"], row["size"]) if seconds > 0 else None


def link_words(ranks: list[int], gpus_per_node: int) -> str:
    from parallel3d.planner.cost import spans_nodes

    return "network" if spans_nodes(ranks, gpus_per_node) else "intra-node"
