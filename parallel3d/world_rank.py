"""What runs on each spawned rank of a multi-rank test world (parallel3d/worlds.py): the rank's loop, the
`Worker` a test function receives, the reports a hung call is named by, and the rendezvous stores."""
from __future__ import annotations

import datetime
import os
import pickle
import queue
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

STATUS_LEN = 512   # bytes of a rank's shared status line
# Contexts a world keeps between calls. Each gloo process group keeps a thread polling its sockets every
# 10 ms, even idle: a suite's worth of meshes cached on 4 idle ranks (158 groups each) took half a core.
CACHED_CONTEXTS = 2
# IDLE_NOTE: a session's idle worlds of 2, 4 and 8 ranks took 0.25 of a core with two cached contexts each, and
# 0.10 with their default groups alone; under pytest-xdist each worker keeps its own. Between test modules
# the worlds therefore drop their contexts (WorldPool.release_groups), and a module that needs a mesh
# builds it again. On Linux the pool also stops a gloo world's ranks between calls (worlds.World.pause), so
# an idle world costs nothing at all there; the trimming still bounds what a world holds while it runs.
# torch.distributed calls whose entry a rank reports, so a hang names the operation it is stuck in
_WATCHED = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_object",
            "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
            "broadcast", "broadcast_object_list", "reduce", "gather", "scatter", "barrier", "send", "recv",
            "batch_isend_irecv")
# (isend/irecv stay unwrapped: P2POp checks its op is torch.distributed.isend/irecv itself)

STORE_TIMEOUT = datetime.timedelta(seconds=600)   # rendezvous and the worlds' process groups


def hosted_store(world_size: int) -> Any:
    """A rendezvous store served by this process on a port the OS picks as it binds it, for ranks this
    process starts. A port picked free and bound later by a rank can be taken in between (a gloo socket's
    ephemeral port, another pytest-xdist worker's world): the rank then fails with EADDRINUSE. The ranks
    connect as clients: `dist.init_process_group(store=client_store(port, n))`, or, through env://,
    with `agent_store_env(store)` (as under torchrun, whose agent serves the store)."""
    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)


def client_store(port: int, world_size: int) -> Any:
    """A rank's connection to the store `hosted_store` serves on `port`."""
    from torch.distributed import TCPStore
    return TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=STORE_TIMEOUT)


def agent_store_env(store: Any) -> dict:
    """Environment for env:// ranks that join `store` (served by this process) instead of serving one."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


@dataclass
class Worker:
    """What a distributed test function sees on its rank."""
    rank: int
    world_size: int
    device: torch.device
    status: Any  # shared char array: the last collective entered (read by the parent on timeout)
    _contexts: dict = field(default_factory=dict)
    _collective: Optional[str] = None  # parallel3d's name of the collective being entered (group and ranks)

    def context(self, spec: Any, strict: bool = False) -> Any:
        """The ParallelContext of `spec` on this world (built once per spec and strictness, stats reset every
        call). strict: the strict test backend (comm/strict.py) with a fresh ledger."""
        from parallel3d.mesh import ParallelContext

        key = (spec, strict)
        ctx = self._contexts.pop(key, None)
        if ctx is None:
            ctx = ParallelContext.build(spec, device=self.device, strict=strict)
            ctx.stats.on_op = self._enter_collective
        self._contexts[key] = ctx          # the most recently used last
        ctx.stats.reset()
        if strict:
            ctx.stats.make_strict()
        return ctx

    def trim_contexts(self, keep: int = CACHED_CONTEXTS) -> None:
        """Before a call: destroy the least recently used contexts beyond `keep` (0: all of them, as
        WorldPool.release_groups asks between test modules). Every rank runs the same calls, so every rank
        destroys the same groups at the same point, and the parent sends a call only once every rank has
        finished the last, so no rank is still in one of them."""
        while len(self._contexts) > keep:
            self._contexts.pop(next(iter(self._contexts))).destroy()

    def report(self, what: str) -> None:
        """Publish what this rank is doing now (the parent prints it if the call times out)."""
        self._collective = None
        self.status.value = what.encode()[: STATUS_LEN - 1]

    def _enter_collective(self, what: str) -> None:
        self.report(what)
        self._collective = what

    def _enter_torch_call(self, what: str) -> None:
        """A torch.distributed call: joined to parallel3d's description when it is the same collective."""
        self.report(f"{self._collective} -> {what}" if self._collective else what)


def _describe(args: tuple) -> str:
    t = next((a for a in args if isinstance(a, torch.Tensor)), None)
    if t is None and args and isinstance(args[0], (list, tuple)):
        t = next((a for a in args[0] if isinstance(a, torch.Tensor)), None)
    return f"tensor {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}" if t is not None else ""


def _watch_torch_distributed(worker: Worker) -> None:
    """Wrap the torch.distributed collectives so each call reports itself before it can block."""
    import torch.distributed as dist

    def wrap(name: str, fn: Callable) -> Callable:
        def watched(*args: Any, **kwargs: Any) -> Any:
            worker._enter_torch_call(f"torch.distributed.{name}({_describe(args)})")
            return fn(*args, **kwargs)
        watched._parallel3d_watched = True
        return watched

    for name in _WATCHED:
        fn = getattr(dist, name, None)
        if fn is not None and not getattr(fn, "_parallel3d_watched", False):
            setattr(dist, name, wrap(name, fn))


def _die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent dies (prctl PR_SET_PDEATHSIG): a rank the pool has
    stopped between calls cannot run its own orphan check. (Linux sends it when the *thread* that started the
    rank ends: a pool used from a short-lived thread loses its worlds with it, and WorldPool.run starts fresh
    ones, since it checks that a world is alive before each call.)"""
    import ctypes
    import signal

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


# the pool may stop a gloo world's ranks between calls (worlds.World.pause): only where they die with it
CAN_PAUSE = sys.platform.startswith("linux")
IDLE = "idle"   # a rank's status between calls (the pool stops a world only once every rank says so)


def worker_main(rank: int, size: int, port: int, backend: str, tasks: Any, results: Any, status: Any,
                 sys_path: list[str]) -> None:
    sys.path[:] = sys_path
    if CAN_PAUSE and not _die_with_parent():
        raise RuntimeError("prctl(PR_SET_PDEATHSIG) failed: a stopped rank could outlive its test process")
    if backend == "gloo":  # CPU ranks run Triton kernels through the interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, store=client_store(port, size), rank=rank, world_size=size,
                            timeout=STORE_TIMEOUT)
    worker = Worker(rank, size, device, status)
    _watch_torch_distributed(worker)
    worker.report(IDLE)  # ready: the parent's per-call timeout starts once every rank is here
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # the test process died (e.g. a crash): do not linger as an orphan
                os._exit(1)
            continue
        if task is None:
            break
        fn, args, kwargs = pickle.loads(task)
        worker.trim_contexts()   # here, not after the last call: every rank has finished that one
        worker.report("running (no collective yet)")
        try:
            out = fn(worker, *args, **kwargs)
            results.put((rank, True, pickle.dumps(out)))
        except BaseException:  # report everything, including assertion errors
            results.put((rank, False, traceback.format_exc()))
        worker.report(IDLE)
    dist.destroy_process_group()


def drop_contexts(worker: Worker) -> None:
    worker.trim_contexts(0)
