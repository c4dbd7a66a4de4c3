"""Building the optimizer's buckets: which parameters go together, and how their storage is set up.

ZeRO 0-2: per model chunk and per reduction group (dense DP x CP / expert-DP), parameters in reverse
registration order (about the order backward produces their gradients) are cut into contiguous buckets of
about `bucket_elems` parameters (parallel.bucket_size; bucket_size_for), so the first buckets are ready, and
reduced, while backward still runs. ZeRO-3: one rows-layout bucket per (unit, group), units being the
blocks and the chunk's root (zero3.py), because a unit is also what is gathered and freed together.
Layouts: buffer.py.

Each bucket is a launch *sequence* member: buckets of one sequence are reduced strictly in order, so
every rank issues the same collectives in the same order even if a bucket is complete earlier on one rank
than on another (e.g. a parameter that got no gradient on some rank: its bucket, and the ones after it,
wait for the end of that chunk's backward pass, where the optimizer launches whatever is left).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import nn

from parallel3d.comm import Group
from parallel3d.data_parallel.buffer import Bucket, Slot, layout, make_slot, split_buckets
from parallel3d.data_parallel.zero3 import Unit, find_units
from parallel3d.mesh import ParallelContext
from parallel3d.params import ParamMeta, full_slices

Named = list[tuple[str, nn.Parameter, bool]]   # (global name, parameter, weight decay?)


DEFAULT_BUCKET = 40_000_000        # Megatron's default bucket: max(40M, 1M x DP) parameters; larger DP
BUCKET_PER_RANK = 1_000_000        # degrees need larger buckets, or the reduce-scatter is latency-bound


def bucket_elems(dp: int, bucket_size: int = 0, bucket_size_mb: float = 0.0, grad_elem_bytes: int = 4) -> int:
    """Parameters per gradient bucket (parallel.bucket_size / bucket_size_mb). Precedence: bucket_size_mb > 0
    (MiB of gradient, the older key) over bucket_size > 0 over the default max(40M, 1M x dp), dp being the
    size of the dense reduction group (DP x CP). A ring reduce-scatter over dp ranks costs 2(dp-1) latency
    steps per bucket, so buckets must grow with dp to stay bandwidth-bound."""
    if bucket_size_mb > 0:
        return max(1, int(bucket_size_mb * 2 ** 20 / grad_elem_bytes))
    if bucket_size > 0:
        return bucket_size
    return max(DEFAULT_BUCKET, BUCKET_PER_RANK * dp)


def reduction_group(ctx: ParallelContext, expert: bool) -> Group:
    return ctx.edp if expert else ctx.dp_cp


def shard_group(ctx: ParallelContext, expert: bool) -> Group:
    """The ZeRO shard group: DP x CP / expert-DP, or under HSDP one block of it (mesh.py); the segment
    reduced there is then summed across `ctx.dp_rep`."""
    return ctx.edp_shard if expert else ctx.dp_shard


def named_params(modules: list[nn.Module], no_decay: Callable[[str, nn.Parameter], bool]) -> list[Named]:
    """Trainable parameters of each chunk, each once (tied copies inside a chunk share one name)."""
    seen: set[int] = set()
    out = []
    for module in modules:
        named = []
        for name, p in module.named_parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if getattr(p, "meta", None) is None:   # a plain torch parameter: whole and unsplit
                p.meta = ParamMeta(tuple(p.shape), full_slices(p.shape))
            named.append((name, p, not no_decay(name, p)))
        out.append(named)
    return out


def plan(modules: list[nn.Module], ctx: ParallelContext, zero: int, no_decay: Callable,
         bucket_elems: float) -> tuple[list[list[Bucket]], list[list[Unit]]]:
    """(launch sequences of buckets, ZeRO-3 unit chains [root, block0, ...] per chunk)."""
    seqs, chains = [], []
    for chunk, (module, named) in enumerate(zip(modules, named_params(modules, no_decay))):
        mine = []
        if zero == 3:
            chain, mine = _unit_buckets(module, named, ctx)
            chains.append(chain)
        else:
            for expert in (False, True):
                part = [x for x in reversed(named) if x[1].meta.expert == expert]
                if part:
                    group = shard_group(ctx, expert) if zero else reduction_group(ctx, expert)
                    n, k = (group.size, group.rank) if zero else (1, 0)
                    bs = split_buckets(part, group, n, k, bucket_elems)
                    for b in bs:
                        b.expert = expert
                    mine.append(bs)
        for bs in mine:
            for b in bs:
                b.seq, b.chunk = len(seqs), chunk
                b.replica = ctx.dp_rep if zero else None
            seqs.append(bs)
    return seqs, chains


def _unit_buckets(module: nn.Module, named: Named, ctx: ParallelContext) -> tuple[list[Unit], list[list[Bucket]]]:
    by_id = {id(x[1]): x for x in named}
    claimed: set[int] = set()
    items: list[tuple[Unit, Named]] = []
    for blk in find_units(module):
        mine = [by_id[id(p)] for p in blk.parameters() if id(p) in by_id and id(p) not in claimed]
        claimed.update(id(x[1]) for x in mine)
        items.append((Unit(blk, [x[1] for x in mine]), mine))
    rest = [x for x in named if id(x[1]) not in claimed]
    root = (Unit(module, [x[1] for x in rest]), rest)
    seqs = []
    for expert in (False, True):
        seq = []
        for unit, mine in items[::-1] + [root]:       # backward order: last block first, root last
            part = [x for x in reversed(mine) if x[1].meta.expert == expert]
            if part:
                group = shard_group(ctx, expert)
                slots = [make_slot(n, p, group.size, d) for n, p, d in part]
                b = Bucket(slots, group, group.size, group.rank, layout(slots, group.size, group.rank), unit=unit,
                           expert=expert)
                unit.buckets.append(b)
                seq.append(b)
        if seq:
            seqs.append(seq)
    return [root[0]] + [u for u, _ in items], seqs


@torch.no_grad()
def fill_segment(b: Bucket, a: int, e: int, out: torch.Tensor) -> torch.Tensor:
    """out <- elements [a, e) of this rank's segment, taken from the parameters (zeros in the padding).
    The whole segment is the initial master; chunks of it initialise state streamed to NVMe."""
    out.zero_()
    for s in b.slots:
        lo, hi = max(a, s.h_seg), min(e, s.h_seg + s.h_len)
        if lo < hi:
            r0 = s.h_param - s.h_seg   # segment position -> position in the flattened parameter
            out[lo - a: hi - a].copy_(s.param.data.reshape(-1)[r0 + lo: r0 + hi])
    return out


@torch.no_grad()
def init_bucket(b: Bucket, zero: int, dtype: torch.dtype, grad_dtype: torch.dtype,
                state_device: Optional[torch.device] = None, resident: bool = True) -> None:
    """fp32 master (this rank's segment; everything for ZeRO-0), Adam state, parameter storage.

    ZeRO-0: parameters become views of one flat buffer (the master itself in fp32, so no copy).
    state_device (optimizer offload): master and Adam state on the host; parameters keep a device copy.
    resident=False (NVMe offload): no master or Adam tensors here (offload/nvme.py holds them in files).
    ZeRO-1/2: parameters become views of one flat buffer of the whole bucket in the compute dtype
    (`param_flat`, N * S elements, Megatron's parameter buffer): the step's all-gather lands in it in place.
    ZeRO-3: a persistent shard in the compute dtype (the master itself in fp32); parameters are freed.
    """
    dev = b.slots[0].param.device
    home = dev if state_device is None else state_device  # offload: the optimizer state lives on the host
    master = None
    if resident:
        pin = home.type == "cpu" and dev.type == "cuda"
        master = fill_segment(b, 0, b.seg, torch.empty(b.seg, dtype=torch.float32, device=home, pin_memory=pin))
        b.adam.master = master
        b.adam.exp_avg, b.adam.exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
    if zero in (0, 3):
        if master is not None and dtype == torch.float32 and home == dev:
            b.param_flat = master
        else:
            b.param_flat = fill_segment(b, 0, b.seg, torch.empty(b.seg, dtype=dtype, device=dev))
    if zero == 0:
        for s in b.slots:
            s.param.data = s.flat(b.param_flat).view(s.param.shape)
        b.grad.full = b.grad.shard = torch.zeros(b.numel, dtype=grad_dtype, device=dev)
    elif zero in (1, 2):
        b.param_flat = torch.zeros(b.numel, dtype=dtype, device=dev)          # (N*S,), zero padding
        for s in b.slots:
            whole = s.whole(b.param_flat)
            whole.copy_(s.param.data.reshape(-1))
            s.param.data = whole.view(s.param.shape)
        if zero == 1:
            b.grad.full = torch.zeros(b.numel, dtype=grad_dtype, device=dev)
    else:
        for s in b.slots:
            s.param.data = torch.empty(s.param.shape, dtype=dtype, device=dev)
            s.param.data.untyped_storage().resize_(0)


def local_ties(buckets: list[Bucket]) -> list[tuple[tuple[Bucket, Slot], tuple[Bucket, Slot]]]:
    """Tied copies (meta.tied_to, reduced over the embedding group) whose source is on this rank as well:
    the V pipeline placement puts the first and the last stage on one rank. Their gradients are summed
    locally, and the copy is marked so that norms and checkpoints count the shared rows once."""
    by_name = {s.name: (b, s) for b in buckets for s in b.slots if "embedding" in s.meta.grad_reduce}
    ties = []
    for b, s in by_name.values():
        source = by_name.get(s.meta.tied_to) if s.meta.tied_to else None
        if source is not None:
            s.local_copy = True
            ties.append((source, (b, s)))
    return ties
