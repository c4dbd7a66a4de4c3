"""What one training step really allocates and computes, observed op by op (a TorchDispatchMode).

The same tracker watches a dry-run step on the `meta` stand-in device and a real step on the CPU, so the
two can be compared like for like (tests/test_planner_memory.py).

Memory: every op's output storages are registered when first seen and released when the storage dies
(a weakref finalizer), so live and peak bytes are exactly what the step's tensors occupied. Each storage
gets a category when it is born:
  - storages already alive when tracking starts are the model state, classified by the caller
    (`classify`: params, grads, optimizer);
  - storages allocated while a file of `parallel3d.comm` (not its dry-run fills or strict copies) is
    on the Python stack are communication buffers
    (gather outputs, receive buffers, reduction outputs in flight), unless autograd saves them for
    backward (a sequence-parallel all-gather's output kept by the next linear), which makes them
    activations;
  - storages allocated inside the optimizer's step, its gradient sync and its hooks that outlive the step
    are classified by the caller too (ZeRO-3 reduced shards are gradients);
  - storages allocated by the gradient reduction's own allocator (`data_parallel.sync.grad_buffer`:
    accumulation buffers, reduced segments) are gradients, whenever they are freed (ZeRO-2/3 free them
    after each bucket's reduction, in the step);
  - everything else allocated during the step is activations (saved tensors, temporaries, autograd's
    parameter gradients before the optimizer's hook takes them).

Compute: every op but the copies by which the simulated backend fills a collective's output
(`comm.transfer_stand_ins`: the collective's own price covers moving those bytes) gets its FLOPs
(torch.utils.flop_counter's formulas, the ones FlopCounterMode uses), its bytes read and written (tensor
arguments and results, views cost nothing), the bytes of the outputs it allocated, and the wall time at
which it ran, so the planner can attribute modeled time to the pipeline action that ran it; on request
(`signatures`), the op's signature, by which a measured machine prices it (planner/op_replay.py), and
each input's reuse distance (the bytes moved since it was last touched: past the cache, it comes from
memory).
"""
from __future__ import annotations

import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

aten = torch.ops.aten
# in-place matmuls (an accumulating d weight: the fused head's addmm_) count as their out-of-place forms
_IN_PLACE = {aten.addmm_: aten.addmm, aten.baddbmm_: aten.baddbmm}

from parallel3d.host_sync import HostSyncs, blocking_upload
from parallel3d.planner.host_kernels import FLOPS as HOST_FLOPS
from parallel3d.planner.kernels import CAUSAL_ARG
from parallel3d.planner.op_replay import signature_of_leaves

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm_buffers")

# ops that allocate or alias without moving data
_FREE_OPS = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias",
             "lift_fresh", "_to_copy_meta", "set_", "resize_"}


@dataclass
class OpCost:
    wall: float          # time.perf_counter() when the op ran
    flops: float
    nbytes: float        # bytes read + written
    dtype: torch.dtype   # of the first floating-point input (picks the peak FLOP/s)
    backward: bool
    name: str = ""       # aten op name (the planner maps some to our kernels)
    head_dim: int = 0    # last dim of the first input
    causal: bool = False
    key: str = ""        # op_replay.signature's key, where the tracker records signatures
    # with signatures: (bytes, reuse distance) of each tensor input, the distance being the bytes the step's
    # ops moved since its storage was last read or written (-1: not touched before in this step)
    reuse: tuple = ()
    fresh_bytes: int = 0  # bytes of the output storages this op allocated (where a step's allocator put them)


@dataclass
class _Alloc:
    nbytes: int
    category: str
    born: int            # event counter at allocation
    died: Optional[int] = None
    resizes: list = field(default_factory=list)  # (event counter, new nbytes): ZeRO-3 frees by resize_(0)


_TORCH_DIR = os.path.dirname(torch.__file__)


def _caller():
    """The frame of the code that called the op being dispatched: the first one above the dispatch mode
    (this file) and torch's own wrappers of it."""
    frame = sys._getframe(2)
    while frame.f_back is not None and (frame.f_code.co_filename == __file__
                                        or frame.f_code.co_filename.startswith(_TORCH_DIR)):
        frame = frame.f_back
    return frame


@dataclass
class StepTracker(TorchDispatchMode):
    """Use as a context manager around a step. `classify(storage) -> category or None` names the model-state
    storages (called for pre-existing tensors via `adopt` and, at the end, for storages the step created
    that are still alive)."""
    device_type: str = "meta"  # only storages on this device are counted (the CPU-side data is not)
    allocs: list = field(default_factory=list)
    ops: list = field(default_factory=list)
    _index: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)
    _clock: int = 0
    _comm_files: tuple = ()
    _grad_code: object = None
    _stand_ins: frozenset = frozenset()   # code of comm's transfer stand-ins: their copies are not compute
    _watched: list = field(default_factory=list)  # (weakref to storage, alloc index) polled for resizes
    syncs: Optional[HostSyncs] = None  # where blocking host-to-device copies onto the device are counted
    # signature -> replay spec of every distinct op (planner/op_replay.py), when the caller asks for them
    signatures: Optional[dict] = None
    _moved: int = 0      # bytes read + written by the ops so far (the reuse distances' clock)
    _touched: "weakref.WeakKeyDictionary" = field(default_factory=weakref.WeakKeyDictionary)

    def __post_init__(self) -> None:
        super().__init__()
        import parallel3d.comm as comm_module
        from parallel3d.comm import collectives, gathers, gloo, group, p2p
        from parallel3d.data_parallel.sync import grad_buffer
        # comm's buffers (gloo.py's: the reduce-scatter's receive buffers), not the dry run's fills (simulated.py)
        self._comm_files = tuple(m.__file__ for m in (group, collectives, p2p, gathers, gloo))
        self._grad_code = grad_buffer.__code__
        self._stand_ins = frozenset(f.__code__ for f in comm_module.transfer_stand_ins())
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def __enter__(self):
        self._saved.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._saved.__exit__(*exc)
        return out

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        """Whatever autograd keeps for backward is an activation, wherever it was allocated."""
        idx = self._index.get(t.untyped_storage()) if t.device.type == self.device_type else None
        if idx is not None and self.allocs[idx].category == "comm_buffers":
            self.allocs[idx].category = "activations"
        return t

    # ------------------------------------------------------------------ memory
    def adopt(self, tensors, category: str, resizable: bool = False) -> None:
        """Register live tensors (the model state built before tracking) under `category`. `resizable`:
        storages that are freed and refilled in place (`untyped_storage().resize_`, which no dispatch mode
        sees), so their size is polled at every op (ZeRO-3's parameters)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                storage = t.untyped_storage()
                self._register(storage, category)
                idx = self._index.get(storage)
                if resizable and idx is not None and all(i != idx for _, i in self._watched):
                    self._watched.append((weakref.ref(storage), idx))

    def _register(self, storage, category: str) -> None:
        if storage in self._index or (storage.nbytes() == 0 and not category == "params"):
            return
        self._clock += 1
        rec = _Alloc(storage.nbytes(), category, self._clock)
        idx = len(self.allocs)
        self.allocs.append(rec)
        self._index[storage] = idx
        weakref.finalize(storage, self._free, idx)

    def _free(self, idx: int) -> None:
        self._clock += 1
        self.allocs[idx].died = self._clock

    def _born_as(self) -> str:
        """The category of a storage born now, from who is on the Python stack (module docstring)."""
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code is self._grad_code:
                return "grads"
            if frame.f_code.co_filename in self._comm_files:
                return "comm_buffers"
            frame = frame.f_back
        return "activations"

    def _poll_resizes(self) -> None:
        for ref, idx in self._watched:
            storage, a = ref(), self.allocs[idx]
            if storage is None:
                continue
            now = storage.nbytes()
            if now != (a.resizes[-1][1] if a.resizes else a.nbytes):
                self._clock += 1
                a.resizes.append((self._clock, now))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._watched:
            self._poll_resizes()
        if self.syncs is not None and blocking_upload(func, args, kwargs, self.device_type):
            self.syncs.add("upload")  # a host sync on CUDA (reads of values are counted where they happen)
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        fresh = [t.untyped_storage() for t in outs if t.device.type == self.device_type]
        fresh = [s for s in fresh if s not in self._index]
        flat, born = None, 0   # born: bytes of the storages this op allocated (not an input first seen here)
        if fresh:
            category = self._born_as()
            for s in fresh:
                self._register(s, category)
            flat = tree_flatten((args, kwargs))
            ins = {t.untyped_storage() for t in flat[0] if isinstance(t, torch.Tensor)}
            born = sum(s.nbytes() for s in fresh if s not in ins)
        name = func._overloadpacket.__name__
        if not (func.is_view or name in _FREE_OPS) and _caller().f_code not in self._stand_ins:
            self._cost(func, name, args, kwargs, out, outs, born, flat or tree_flatten((args, kwargs)))
        return out   # (a dry run's fill stands for the network: comm.transfer_stand_ins)

    def _cost(self, func, name: str, args, kwargs, out, outs, fresh_bytes: int, flat: tuple) -> None:
        leaves, tree = flat
        ins = [t for t in leaves if isinstance(t, torch.Tensor)]
        nbytes = sum(t.numel() * t.element_size() for t in ins + outs)
        flops = 0.0
        # our kernels' ops register theirs (kernels/ops.py); aten's CPU flash ops are counted here
        formula = (flop_registry.get(func._overloadpacket) or flop_registry.get(_IN_PLACE.get(func._overloadpacket))
                   or HOST_FLOPS.get(name))
        if formula is not None:
            flops = float(formula(*args, **kwargs, out_val=out))
        index = CAUSAL_ARG.get(name)
        causal = index is not None and bool(args[index])
        dtype = next((t.dtype for t in ins if t.is_floating_point()), torch.float32)
        backward = torch._C._current_graph_task_id() != -1
        head_dim = int(ins[0].shape[-1]) if ins and ins[0].dim() else 0
        key, reuse = "", ()
        if self.signatures is not None:
            key, spec = signature_of_leaves(func, leaves, tree)
            self.signatures.setdefault(key, spec)
            reuse = self._reuse(ins, outs, nbytes)
        self.ops.append(OpCost(time.perf_counter(), flops, float(nbytes), dtype, backward, name, head_dim, causal,
                               key, reuse, fresh_bytes))

    def _reuse(self, ins: list, outs: list, nbytes: int) -> tuple:
        """Each input's (bytes, reuse distance) (OpCost.reuse), then this op's own traffic on the clock."""
        found = []
        for t in ins:
            if t.device.type == self.device_type:
                last = self._touched.get(t.untyped_storage(), {}).get(t.storage_offset())
                found.append((t.numel() * t.element_size(), -1 if last is None else self._moved - last))
        self._moved += nbytes
        for t in ins + outs:   # per storage and offset: a flat buffer's views (parameters, AdamW's blocks) apart
            if t.device.type == self.device_type:
                self._touched.setdefault(t.untyped_storage(), {})[t.storage_offset()] = self._moved
        return tuple(found)

    # ------------------------------------------------------------------ results
    def finish(self, classify: Callable[[object], Optional[str]]) -> None:
        """Give storages that are still alive their final category (model state the step created)."""
        for storage, idx in list(self._index.items()):
            category = classify(storage)
            if category is not None:
                self.allocs[idx].category = category

    def peak(self, exclude: tuple[str, ...] = ()) -> tuple[int, dict[str, int]]:
        """(peak live bytes, the live bytes per category at that moment), not counting the categories in
        `exclude` (the planner: the device peak once offload takes the gradients away)."""
        if self._watched:
            self._poll_resizes()
        events = []
        for a in self.allocs:
            if a.category in exclude:
                continue
            size = a.nbytes
            events.append((a.born, size))
            for when, new in a.resizes:
                events.append((when, new - size))
                size = new
            if a.died is not None:
                events.append((a.died, -size))
        events.sort(key=lambda e: e[0])
        live, best, best_at = 0, -1, 0
        for when, delta in events:
            live += delta
            if live > best:
                best, best_at = live, when
        split = dict.fromkeys(CATEGORIES, 0)
        for a in self.allocs:
            if a.category in exclude:
                continue
            if a.born <= best_at and (a.died is None or a.died > best_at):
                split[a.category] += _size_at(a, best_at)
        return max(best, 0), split

    def live(self) -> dict[str, int]:
        """Bytes per category alive now."""
        if self._watched:
            self._poll_resizes()
        split = dict.fromkeys(CATEGORIES, 0)
        for a in self.allocs:
            if a.died is None:
                split[a.category] += a.resizes[-1][1] if a.resizes else a.nbytes
        return split


def _size_at(a: _Alloc, when: int) -> int:
    size = a.nbytes
    for at, new in a.resizes:
        if at > when:
            break
        size = new
    return size
