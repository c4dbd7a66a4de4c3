"""Measured op times for the machine the planner runs on (`launch/plan.py --gpu cpu`): every distinct op of
the dry run, replayed on real tensors of its shapes, strides and dtypes, and timed.

Why not the roofline there: a CPU's aten kernels run far from any roofline, and do work the dispatch-level
tracker never sees (casts and adds inside a kernel, the fused head's vocabulary-sized `addmm_` with its
own accumulation, the CPU flash-attention backward's loops). At world 1 the roofline-priced ops of
llama_100m came to 0.43 of their profiled time. Timing the op itself on this machine is the hardware
profile at the grain the planner prices: what the code runs, on the machine it runs on.

An op's signature is its aten overload, each tensor argument's shape, strides and dtype, and every other
argument but float scalars (devices read as one, so the `meta` stand-in's ops and the CPU's compare).
Replayed values: floating tensors uniform in [0.5, 1.5) (a square root of a negative number, a NaN, ran
80x slower than of a positive one here, and training takes the square roots of second moments), integer
tensors zeros (every index in range), booleans true. An op that fails on them (a division by an integer
zero, a shape that depends on values it did not get) is left to the roofline: `measure` returns no time
for it.

Timing: one thread (a torchrun rank's), one warm-up call, then the median of a few calls. A small op is also
timed in its action's order (`replay_in_order` over a stretch of `segments`), each call after the ops the
action runs before it, which is where the step runs it: after itself, its code and data sit in the core's own caches. An op is also
timed writing its output into memory outside the cache (`replay_cold_output`), where a step's allocator
puts a fresh output; the dry run adds that extra to the ops that allocate theirs. Replays run with the
allocator a CPU run sets (parallel3d/host_memory.py), so a replayed op does not fault its output in. Not
measured here: what the host adds around the op (Python modules, autograd, hooks: profile.py's per-op overhead)
and what ranks computing at once cost each other (profile_gloo.py's slowdown); cpu_device adds both.

Every time is kept at one speed of the machine: each replay (each pass of an order) is scaled by a probe
timed just before it against the cache's reference probe (replay_speed.py), since this VM's speed moves
under load from outside and an op's one replay caught whichever spell it fell in.

Cache: beside the hardware profile (profile.cache_path), `ops-` + its file name: signature -> seconds (an op's
time in order per stretch and signature: in_order_key), and `speed_s`, the reference probe they are kept at.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from parallel3d.host_memory import keep_freed_memory
from parallel3d.planner import replay_speed

VERSION = 10           # 2: a GEMM's output written to memory outside the cache; 3: any op's (replay_cold_output),
                       # and replays under the run's allocator (host_memory.keep_freed_memory); 4: small ops
                       # timed in the step's order (replay_in_order); 5: cached per step order (in_order_key); 6: denormals
                       # flushed while replaying (_one_thread); 7: in order per action (segments); 8: kept at
                       # the speed of the cache's reference (replay_speed.py); 9: its probe timed warm; 10: and
                       # the flush kept on between passes (_one_thread not nested)
SLOW_OP_S = 0.02       # ops slower than this are timed twice after the warm-up, the others five times
SCALED_ROUNDS = 3      # rounds of those five, each scaled by its own probe (replay_speed.py): one is as noisy as none
COLD = "cold-output|"  # the cache's key of an op's cold-output extra: COLD + its signature's key
COLD_SPAN = 64 << 20   # bytes of outputs a cold-output replay writes before timing the first: past the cache
COLD_MIN_BYTES = 256 << 10   # smaller outputs come back hot from the allocator's recent frees (and cost little)
COLD_CALLS = 32        # calls timed each way
ORDER = "in-order|"    # the prefix of the cache's keys of ops' times in order (in_order_key)
ORDER_MAX_BYTES = 1 << 20   # ops whose tensors total more are timed alone only: their time is their bytes' and
                            # FLOPs', which the cold-input and cold-output terms already place in memory
ORDER_PASSES = 5       # passes over the step's small ops; each op's time is the median of its calls
# what an op raises on replay values (module docstring): it is left to the roofline
REPLAY_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError, ZeroDivisionError)


def signature(func, args: tuple, kwargs: dict) -> tuple[str, tuple]:
    """(key, replay spec) of one op call. The spec holds what `replay` needs to rebuild the call."""
    return signature_of_leaves(func, *tree_flatten((args, kwargs)))


def signature_of_leaves(func, leaves: list, tree) -> tuple[str, tuple]:
    """`signature` of a call whose (args, kwargs) the caller has flattened already (the tracker has)."""
    spec, parts = [], [str(func)]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            item = ("T", tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype)
            parts.append(f"T{item[1]}{item[2]}{item[3]}")
        elif isinstance(leaf, torch.device):
            item = ("D",)
            parts.append("D")
        else:   # a float scalar (a learning rate, a scale) changes no op's time: one key for every value
            item = ("V", leaf)
            parts.append("f" if isinstance(leaf, float) else repr(leaf))
        spec.append(item)
    parts.append(str(tree))
    return "|".join(parts), (func, tree, tuple(spec))


def _tensor(shape: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of these shape and strides (overlapping ones included) with replay values."""
    n = 1 + sum((s - 1) * st for s, st in zip(shape, stride)) if all(shape) else 0
    if dtype == torch.bool:
        base = torch.ones(n, dtype=dtype)
    elif dtype.is_floating_point or dtype.is_complex:
        base = (torch.rand(n) + 0.5).to(dtype)
    else:
        base = torch.zeros(n, dtype=dtype)
    return base.as_strided(shape, stride)


def _call(spec: tuple) -> tuple[Callable[[], object], tuple, dict]:
    func, tree, items = spec
    leaves = []
    for item in items:
        if item[0] == "T":
            leaves.append(_tensor(*item[1:]))
        elif item[0] == "D":
            leaves.append(torch.device("cpu"))
        else:
            leaves.append(item[1])
    args, kwargs = tree_unflatten(leaves, tree)
    return lambda: func(*args, **kwargs), args, kwargs


@contextmanager
def _one_thread():
    """Replays run on one thread, as a torchrun rank does, with denormals flushed to zero: an in-place op
    replayed thousands of times over the same values (in the step's order, llama_100m's AdamW `mul_` by
    beta2 over 835 chunks, five passes) drives them into the denormal range, where this CPU took 525 us a
    call against 11 in the normal range, which a training step's data never reach."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
        torch.set_num_threads(threads)


def replay(spec: tuple, scale: Optional[Callable[[], float]] = None) -> Optional[float]:
    """Seconds of one op on this CPU, one thread (module docstring); None where the op cannot be replayed.
    `scale()`, where given (measure): the factor of the calls timed after it, called before each of
    SCALED_ROUNDS rounds of calls (a slow op's one round is long enough); the median round counts."""
    try:
        with _one_thread():
            run = _call(spec)[0]
            t0 = time.perf_counter()
            run()                                     # warm-up: first-touch pages, lazy kernel setup
            first = time.perf_counter() - t0
            rounds = []
            for _ in range(SCALED_ROUNDS if scale is not None and first <= SLOW_OP_S else 1):
                factor = scale() if scale is not None else 1.0
                times = []
                for _ in range(2 if first > SLOW_OP_S else 5):
                    t0 = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - t0)
                rounds.append(statistics.median(times) * factor)
            return statistics.median(rounds)
    except REPLAY_ERRORS:
        return None


def replay_cold_output(spec: tuple, scale: Optional[Callable[[], float]] = None) -> Optional[float]:
    """Seconds an op takes more writing its output into memory outside the cache than into the buffer its
    last call wrote, which is where `replay` writes it (the allocator hands the freed block back). A step's
    allocator hands a fresh output a block it last used long ago: one llama_100m step at world 1 ran its
    GEMMs at 1.48x their replayed time, and a (256, 768) @ (768, 2048) bf16 GEMM here took 0.88 ms into a
    hot buffer, 1.15 with its weight from memory, 1.50 with its output there too, 1.56 in the step; its
    out-of-place muls ran at 2.1x. Measured per signature, since the extra per byte moves with the op, shape
    and dtype (0.03-0.1 ns for small fp32 GEMMs, 0.26-0.29 for bf16 ones of a llama_100m layer): the op's
    `.out` overload into buffers written COLD_SPAN ago, against the same call into one buffer. None where
    the op has no single output of COLD_MIN_BYTES or more, no `.out` overload, or cannot be replayed.
    `scale()`, where given (measure): the factor of the difference, called just before the timed calls."""
    try:
        with _one_thread():
            run, args, kwargs = _call(spec)
            out = run()
            if not isinstance(out, torch.Tensor) or out.untyped_storage().nbytes() < COLD_MIN_BYTES:
                return None
            n = max(2, COLD_SPAN // out.untyped_storage().nbytes())
            calls = min(n, COLD_CALLS)
            buffers = [torch.zeros_like(out) for _ in range(n)]   # paged in, as the step's heap is
            variant = spec[0]._overloadpacket.out
            variant(*args, **kwargs, out=buffers[-1])             # the last one, now hot
            factor = scale() if scale is not None else 1.0
            hot, cold = [], []
            for _ in range(calls):
                t0 = time.perf_counter()
                variant(*args, **kwargs, out=buffers[-1])
                hot.append(time.perf_counter() - t0)
            for i in range(calls):   # buffer i was last written COLD_SPAN of later buffers ago: out of the cache
                t0 = time.perf_counter()
                variant(*args, **kwargs, out=buffers[i])
                cold.append(time.perf_counter() - t0)
            return max(0.0, statistics.median(cold) - statistics.median(hot)) * factor
    except (*REPLAY_ERRORS, AttributeError):   # AttributeError: no `.out` overload
        return None


def _tensor_bytes(spec: tuple) -> int:
    return sum(math.prod(item[1]) * item[3].itemsize for item in spec[2] if item[0] == "T")


def replay_in_order(specs: dict, order: list, scale: Optional[Callable[[], float]] = None) -> dict:
    """signature -> median seconds of its calls when the ops of `order` (the step's signatures, in its order)
    run one after another, ORDER_PASSES times over, for the ops whose tensors total at most ORDER_MAX_BYTES.

    Timed alone, an op runs after itself, its code and data in the core's own caches; in the step it runs
    after other ops. tiny's step at world 1 (2,249 ops, 139 distinct) replayed to 30-33 ms alone and 44-49
    ms in order, and ran 78.5 ms against a plan of 60.0; the minimal model behind the per-op overhead
    (profile._step_overhead) 1.9 and 3.4 ms over its 686 ops, so the overhead holds about 2 us an op of it
    and a model of larger small ops lacked the rest. `scale()`, where given, is called before each pass: the
    factor of that pass's times (measure: the machine's speed then against the cache's reference)."""
    calls: dict = {}
    with _one_thread():
        for key in dict.fromkeys(order):
            spec = specs[key]
            if _tensor_bytes(spec) > ORDER_MAX_BYTES:
                continue
            try:
                run = _call(spec)[0]
                run()
            except REPLAY_ERRORS:
                continue
            calls[key] = run
        seconds: dict = {key: [] for key in calls}
        sequence = [key for key in order if key in calls]
        for _ in range(ORDER_PASSES):
            factor = scale() if scale is not None else 1.0
            for key in sequence:
                t0 = time.perf_counter()
                calls[key]()
                seconds[key].append((time.perf_counter() - t0) * factor)
    return {key: statistics.median(v) for key, v in seconds.items()}


def in_order_key(order: list, key: str) -> str:
    """The cache's key of signature `key`'s time in the stretch of ops whose signatures in order are `order`
    (an action of the step: `segments`). An op's time in order depends on the ops around it, so each
    stretch keeps its own: keyed by signature alone, the first step that timed one lent it to every other.
    tiny's plan timed llama_100m's AdamW chunk ops (131,072 fp32) at 77-88 us in tiny's order, and
    llama_100m's plan then read them there, against 38-40 us in its own order and 30-104 us timed in its
    real step: 150 ms too much on its optimizer."""
    digest = hashlib.sha1("\n".join(order).encode()).hexdigest()[:16]
    return f"{ORDER}{digest}|{key}"


def segments(keys: list, labels: list) -> list:
    """The step's op signatures `keys` cut where their `labels` (the action each op ran in) change: the
    stretches of ops each action runs, in order. Stretches with the same ops in the same order (the same
    action of two microbatches, or of two layouts: the forward of dp2 ZeRO-0 and ZeRO-1) are one stretch
    to `measure`, timed once: timed as parts of two whole steps minutes apart, tiny's ZeRO-0 and ZeRO-1
    pipelines were priced 44.7 and 64.9 ms on this VM for the same ops."""
    out: list = []
    last = object()
    for key, label in zip(keys, labels):
        if not out or label != last:
            out.append([])
            last = label
        out[-1].append(key)
    return out


def replayed_seconds(measured: dict, key: str, in_order: str = "") -> Optional[float]:
    """The time a plan prices an op at, from `measure`'s answer: its time in its stretch's order where it
    has one (a small op; `in_order`: in_order_key(stretch, "")), else its time alone; None where it could not
    be replayed."""
    return (measured.get(in_order + key) if in_order else None) or measured.get(key)


def _read_cache(path: Optional[Path]) -> tuple[dict, Optional[float]]:
    """The cache at `path`: (its op times, the reference probe they are kept at); nothing where it is
    missing, unreadable or of another VERSION."""
    if path is None or not path.exists():
        return {}, None
    try:
        found = json.loads(path.read_text())
        if found.get("version") == VERSION:
            return found["ops"], found.get("speed_s")
    except (OSError, ValueError, KeyError):
        pass
    return {}, None


def speed_note(path: Path) -> Optional[str]:
    """replay_speed.drift_note for the cache at `path` against this machine now (one thread, about 0.3 s);
    None where the cache has no reference (missing, of another version) or is within the drift."""
    _, reference = _read_cache(path)
    if not reference:
        return None
    with _one_thread():
        now_s = replay_speed.now(replay_speed.Probe())
    return replay_speed.drift_note(reference, now_s, os.getloadavg()[0], str(path))


def measure(specs: dict, path: Optional[Path] = None, stretches: Optional[list] = None) -> dict:
    """signature -> seconds for every op of `specs` (signature -> replay spec), and COLD + signature -> its
    cold-output extra (replay_cold_output), from the cache at `path` where it has them, replayed (and
    cached) where not, with the allocator set as a CPU run sets it (host_memory.keep_freed_memory: a freed
    block is reused, not handed back to be faulted in again). What cannot be replayed maps to None.
    `stretches` (the step's signatures in order, cut by action: `segments`): also in_order_key(stretch,
    signature) -> the op's time in its stretch's order (replay_in_order), for its small ops; the others map
    to None."""
    cached, reference = _read_cache(path)   # reference: the probe's seconds the times are kept at (replay_speed.py)
    wanted = {**{key: (replay, spec) for key, spec in specs.items()},
              **{COLD + key: (replay_cold_output, spec) for key, spec in specs.items()}}
    by_prefix = {in_order_key(stretch, ""): stretch for stretch in stretches or ()}   # each distinct stretch once
    in_order = [prefix + key for prefix, stretch in by_prefix.items() for key in dict.fromkeys(stretch)]
    missing = [key for key in wanted if key not in cached]
    unordered = {prefix: stretch for prefix, stretch in by_prefix.items()
                 if any(prefix + key not in cached for key in stretch)}
    if missing or unordered:
        keep_freed_memory()
        probe = replay_speed.Probe()
        with _one_thread():
            reference = reference or probe.reference()

        def scale() -> float:   # this moment's speed against the reference's: each replay is kept at the reference's
            return reference / probe()   # on one thread: called inside the replays' own _one_thread
    with torch.no_grad():
        for key in missing:
            how, spec = wanted[key]
            cached[key] = how(spec, scale)
        for prefix, stretch in unordered.items():   # each stretch whole, for the context
            timed = replay_in_order(specs, stretch, scale=scale)
            cached.update({prefix + key: timed.get(key) for key in stretch})
    if (missing or unordered) and path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": VERSION, "speed_s": reference, "ops": cached}))
        tmp.replace(path)
    return {key: cached[key] for key in [*wanted, *in_order]}
