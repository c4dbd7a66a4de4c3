"""ZeRO-3: parameters live as 1/N shards and are all-gathered around each unit's forward and backward.

Units: the children of the first `nn.ModuleList` / `nn.ModuleDict` found on each path from a model chunk
(the transformer blocks), plus the chunk itself ("root") for every remaining parameter (embedding, final
norm, LM head; they may be used directly in the chunk's forward, e.g. a tied head through F.linear, so
only the chunk's own forward brackets their use).

    forward   root.pre: gather root, prefetch block0 │ block i.pre: wait block i, prefetch block i+1
              block i.post: free block i             │ root.post: free root
    backward  (grad of root output) gather root, prefetch block n-1
              (grad of block i output) wait block i, prefetch block i-1
              a unit is freed once every one of its parameters has received its gradient

With a `fetch` (parameter offload, or an offloaded optimizer's parameter copies in flight) the persistent
shard comes from elsewhere, and the prefetch reaches one unit further: when unit i starts, unit i+1's
gather is launched and unit i+2's fetch is issued (`start_fetch`: a host->device copy, NVMe reads on I/O
threads), so the gather of a unit waits only for a fetch issued a whole unit earlier (`read_ahead=False`
issues it with the gather instead, for benchmarks).

Per step and microbatch every parameter is gathered twice (forward, backward) and its gradient
reduce-scattered once: 3x the parameter bytes, vs 2x for DP's all-reduce (counted as 2x in ring terms).

Freeing = resizing the parameter's storage to 0 bytes; gathering resizes it back and copies the chunks
in through `p.data` (which does not bump the autograd version counter), so tensors autograd saved during
forward (the weight or views of it) are valid again when backward runs -- the FSDP1 storage trick.
Gathers run on a clone of the DP group (`ParallelContext.clone`), so they are ordered independently
of the gradient reduce-scatters.

ZeRO++ (`ZeroPP`): qwZ gathers int8 blocks + scales instead of the compute dtype (quantize.py; the
persistent shard, i.e. the master, stays exact); hpZ keeps, after each forward gather, this rank's 1/M
slice of the gathered bucket (M = the shard group's members on this node) and gathers the backward copy
from those secondary slices over the node group only; the copies are dropped when the parameters change
(`invalidate`, after every optimizer step or load). fp8 gathers (`ZeroPP.fp8`, fp8_gather.py): the
weights of the fp8 linears travel as e4m3 bytes with a scale consistent across the shards and stay in that
form (the parameter's storage stays freed). Activation recomputation re-enters a unit's forward inside backward:
then the unit is gathered but neither freed nor re-hooked.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from parallel3d.comm import Group, local_work, start_all_gather, wait_work
from parallel3d.data_parallel.buffer import Bucket, copy_rows_out
from parallel3d.data_parallel.fp8_gather import drop, fp8_all_gather, fp8_slots
from parallel3d.data_parallel.quantize import quantized_all_gather
from parallel3d.params import in_backward


@dataclass
class ZeroPP:
    """ZeRO++ options of the parameter gathers: quant_block > 0 turns on qwZ; `node` (expert-ness ->
    the shard group's members on this node) turns on hpZ; fp8 gathers the fp8 linears' weights in fp8."""
    quant_block: int = 0
    node: Optional[dict[bool, Group]] = None
    fp8: bool = False


def find_units(root: nn.Module) -> list[nn.Module]:
    """Block modules of one model chunk (children of the first container on each path)."""
    units: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                units.extend(child.children())
            else:
                visit(child)

    visit(root)
    return units


@dataclass
class Unit:
    module: nn.Module
    params: list[nn.Parameter]
    buckets: list[Bucket] = field(default_factory=list)
    gathered: bool = False
    pending: Optional[list] = None
    fetched: Optional[list] = None    # Fetched (offload/streams.py) per bucket, issued ahead of the gather
    grads_left: int = 0
    next_fwd: Optional["Unit"] = None
    next_bwd: Optional["Unit"] = None


def check_split_backward(split: bool) -> None:
    """ZeRO-3 gathers a unit when the gradient of its output arrives and frees it when its parameters'
    gradients have; a split backward (zero-bubble schedules) computes the weight gradients later, from
    recorded intermediates that bypass those triggers, after later forwards have freed the unit."""
    if split:
        raise ValueError("ZeRO-3 (parallel.zero=3) does not support a schedule that splits backward into "
                         "input and weight passes (zb-h1); use zero<=2 or schedule=1f1b/interleaved")


class Zero3:
    """Gathers/frees units around forward and backward: a model wrapper, attached to the chunks by
    attach.attach_zero3 before the optimizer is built. chains: per chunk [root, block0, ...] (build.plan);
    seqs: the units' buckets as gradient launch sequences (the optimizer reduces them); `groups` maps
    expert-ness to the gather group."""

    def __init__(self, chains: list[list[Unit]], seqs: list[list[Bucket]], groups: dict[bool, Group],
                 dtype: torch.dtype, pp: Optional[ZeroPP] = None) -> None:
        self.chains, self.seqs = chains, seqs
        self.units = [u for chain in chains for u in chain]
        self.groups, self.dtype, self.pp = groups, dtype, pp or ZeroPP()
        self.fetch: Optional[Callable[[Bucket], Any]] = None  # offload: bucket -> Fetched shard on the device
        self.read_ahead = True
        self.secondary: dict[int, torch.Tensor] = {}   # hpZ: id(bucket) -> this rank's slice of the gathered bucket
        self.handles = []
        # fp8 gathers: per bucket, the slots that travel (and stay) as fp8 instead of being written back
        self.fp8 = {id(b): fp8_slots(b) for u in self.units for b in u.buckets} if self.pp.fp8 else {}
        for chain in chains:               # chain = [root, block0, block1, ...]
            root, blocks = chain[0], chain[1:]
            fwd = [root] + blocks
            bwd = [root] + blocks[::-1]
            for a, b in zip(fwd, fwd[1:]):
                a.next_fwd = b
            for a, b in zip(bwd, bwd[1:]):
                a.next_bwd = b
            for u in chain:
                self.handles.append(u.module.register_forward_pre_hook(self._pre_forward(u)))
                self.handles.append(u.module.register_forward_hook(self._post_forward(u)))

    # ---- gather / free ------------------------------------------------------------------------------
    def start_fetch(self, unit: Optional[Unit]) -> None:
        """Issue the transfers that bring the unit's shards to the device (nothing to do without `fetch`)."""
        if self.fetch is None or unit is None or unit.gathered or unit.pending is not None or unit.fetched:
            return
        unit.fetched = [self.fetch(b) for b in unit.buckets]

    def start_gather(self, unit: Optional[Unit]) -> None:
        if unit is None or unit.gathered or unit.pending is not None:
            return
        pend, backward = [], in_backward()
        self.start_fetch(unit)
        fetched, unit.fetched = unit.fetched or [None] * len(unit.buckets), None
        for b, f in zip(unit.buckets, fetched):
            shard = b.param_flat if f is None else f.wait()   # the work keeps a fetched copy alive
            full = torch.empty(b.numel, dtype=self.dtype, device=shard.device)   # (N*S,)
            group, secondary = self.groups[b.expert], self.secondary.get(id(b))
            if backward and secondary is not None:     # hpZ: the backward copy comes from inside the node
                group = self.pp.node[b.expert]
                pend.append((b, full, group, start_all_gather(full, secondary, group), False))
            elif self.fp8.get(id(b)):                # fp8 weights (blocking: the scales need a reduction)
                work = local_work(group, "all_gather", [full], lambda: fp8_all_gather(
                    b, shard, full, self.fp8[id(b)], group, backward))
                pend.append((b, full, group, work, True))
            elif self.pp.quant_block:                  # qwZ (blocking: dequantised on arrival)
                scale_dtype = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32
                work = local_work(group, "all_gather", [full], lambda: quantized_all_gather(
                    full, shard, group, self.pp.quant_block, scale_dtype))
                pend.append((b, full, group, work, True))
            else:
                pend.append((b, full, group, start_all_gather(full, shard, group), True))
        unit.pending = pend

    def gather(self, unit: Unit) -> None:
        if unit.gathered:
            return
        self.start_gather(unit)
        for b, full, group, work, primary in unit.pending:
            wait_work(work, group, "all_gather")
            if primary and self.pp.node is not None:   # hpZ: keep my node-local slice for the backward
                node = self.pp.node[b.expert]
                part = full.numel() // node.size
                self.secondary[id(b)] = full[node.rank * part: (node.rank + 1) * part].clone()
            in_fp8 = {id(s) for s in self.fp8.get(id(b), ())}
            for s in b.slots:
                if id(s) in in_fp8:                    # consumed from s.param.fp8.gathered
                    continue
                data = s.param.data
                storage = data.untyped_storage()
                if storage.nbytes() == 0:
                    storage.resize_(data.numel() * data.element_size())
                copy_rows_out(full, b.seg, b.nshard, s, data)
        unit.pending = None
        unit.gathered = True
        unit.grads_left = len(unit.params)

    def free(self, unit: Unit) -> None:
        if unit.pending is not None:  # a prefetch that was not used: finish it before dropping buffers
            for _, _, group, work, _ in unit.pending:
                wait_work(work, group, "all_gather")
            unit.pending = None
        for f in unit.fetched or []:  # a fetch that was not used: its transfers end before its buffers go
            f.wait()
        unit.fetched = None
        for p in unit.params:
            p.data.untyped_storage().resize_(0)
        for b in unit.buckets:
            drop(self.fp8.get(id(b), ()))
        unit.gathered = False

    def invalidate(self) -> None:
        """The parameters changed (optimizer step, load): hpZ's secondary copies are stale."""
        self.secondary.clear()

    def free_all(self) -> None:
        for u in self.units:
            if u.gathered or u.pending is not None or u.fetched:
                self.free(u)

    def free_chunk(self, chunk: int) -> None:
        """The chunk's backward ended: free its units still gathered (a parameter had no gradient)."""
        for unit in self.chains[chunk]:
            if unit.gathered or unit.pending is not None or unit.fetched:
                self.free(unit)

    def on_grad(self, unit: Unit) -> None:
        """A parameter of `unit` received its gradient (after it was added to the bucket)."""
        unit.grads_left -= 1
        if unit.grads_left == 0:
            self.free(unit)

    # ---- hooks ----------------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit):
        def hook(module, args):
            self.gather(unit)
            if not in_backward():
                self._prefetch(unit.next_fwd, "next_fwd")
        return hook

    def _prefetch(self, nxt: Optional[Unit], direction: str) -> None:
        """Launch the next unit's gather; issue the fetch of the one after it (read-ahead)."""
        self.start_gather(nxt)
        if self.read_ahead and nxt is not None:
            self.start_fetch(getattr(nxt, direction))

    def _post_forward(self, unit: Unit):
        def hook(module, args, output):
            if in_backward():   # recomputation inside backward: keep the unit for its backward
                return output
            self.free(unit)
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors and torch.is_grad_enabled():
                torch.autograd.graph.register_multi_grad_hook(tensors, self._pre_backward(unit), mode="any")
            return output
        return hook

    def _pre_backward(self, unit: Unit):
        def hook(grad):
            self.gather(unit)
            self._prefetch(unit.next_bwd, "next_bwd")
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
