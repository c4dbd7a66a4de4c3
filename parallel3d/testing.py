"""Multi-rank tests: run a function on N ranks from pytest, reusing spawned worlds across tests.

As a pytest plugin (`pytest -p parallel3d.testing`, or automatically once parallel3d is installed, through
its `pytest11` entry point) it gives any test suite a fixture:

    def check_sum(worker, scale):             # module-level: it is pickled to the ranks
        t = torch.full((2,), float(worker.rank + 1), device=worker.device)
        torch.distributed.all_reduce(t)
        return t * scale

    def test_sum(multirank):
        results = multirank(check_sum, 4, 10.0)   # fn(worker, *args) on 4 ranks; the list of returns by rank
        assert results[0].tolist() == [100.0, 100.0]

and the markers `gpu` / `multigpu` (skipped without enough CUDA GPUs). Without pytest: `WorldPool().run(n, fn)`.

`fn` receives a `Worker` (rank, world_size, device and `worker.context(spec)`, which builds a
`ParallelContext` once per mesh and reuses it). Worlds stay alive between calls, since spawning 8 ranks
costs seconds. A call that exceeds its timeout (`timeout=` per call; `--multirank-timeout`, default 120 s)
fails with each stuck rank and the last collective it entered (parallel3d's own collectives and the
torch.distributed calls a test makes itself); a rank that raises fails the call with its traceback.
Either way the poisoned world is torn down and the next call spawns a fresh one.

Backend: gloo on CPU; with `backend="auto"` and at least N CUDA GPUs, NCCL with one rank per GPU, so the
same distributed tests double as multi-GPU integration tests.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest
import torch

_STATUS_LEN = 512
DEFAULT_TIMEOUT = 120.0
# Contexts a world keeps between calls. Each gloo process group keeps a thread polling its sockets every
# 10 ms, even idle: a suite's worth of meshes cached on 4 idle ranks (158 groups each) took half a core.
CACHED_CONTEXTS = 2
# IDLE_NOTE: a session's idle worlds of 2, 4 and 8 ranks took 0.25 of a core with two cached contexts each, and
# 0.10 with their default groups alone; under pytest-xdist each worker keeps its own. Between test modules
# the worlds therefore drop their contexts (WorldPool.release_groups), and a module that needs a mesh
# builds it again.
# torch.distributed calls whose entry a rank reports, so a hang names the operation it is stuck in
_WATCHED = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_gather_object",
            "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "broadcast", "broadcast_object_list",
            "reduce", "gather", "scatter", "barrier", "send", "recv", "batch_isend_irecv")
# (isend/irecv stay unwrapped: P2POp checks its op is torch.distributed.isend/irecv itself)


class WorldError(RuntimeError):
    """A rank raised, or the call timed out (message names the ranks and their last collective)."""


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

    def context(self, spec: Any) -> Any:
        """The ParallelContext of `spec` on this world (built once per spec, stats reset every call)."""
        from parallel3d.mesh import ParallelContext

        ctx = self._contexts.pop(spec, None)
        if ctx is None:
            ctx = ParallelContext.build(spec, device=self.device)
            ctx.stats.on_op = self._enter_collective
        self._contexts[spec] = ctx          # the most recently used last
        ctx.stats.reset()
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
        self.status.value = what.encode()[: _STATUS_LEN - 1]

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


def _worker_main(rank: int, size: int, port: int, backend: str, tasks: Any, results: Any, status: Any,
                 sys_path: list[str]) -> None:
    sys.path[:] = sys_path
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
    worker.report("idle")  # ready: the parent's per-call timeout starts once every rank is here
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
        worker.report("idle")
    dist.destroy_process_group()


class World:
    """`size` spawned ranks with an initialised default group, waiting for tasks."""

    def __init__(self, size: int, backend: str) -> None:
        ctx = mp.get_context("spawn")
        self.size, self.backend = size, backend
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(size)]
        self.status = [ctx.Array("c", _STATUS_LEN) for _ in range(size)]
        self.store = hosted_store(size)   # served here for the world's life
        port = self.store.port
        self.procs = [ctx.Process(target=_worker_main, daemon=True,
                                  args=(r, size, port, backend, self.tasks[r], self.results, self.status[r],
                                        list(sys.path)))
                      for r in range(size)]
        for p in self.procs:
            p.start()

    def wait_ready(self, timeout: float = 600.0) -> None:
        """Block until every rank has joined the process group (start-up does not count against a call)."""
        deadline = time.monotonic() + timeout
        while not all(st.value for st in self.status):
            if not self.alive or time.monotonic() > deadline:
                self.close()
                raise WorldError(f"a world of {self.size} ranks ({self.backend}) did not start: ranks "
                                 f"{[r for r, st in enumerate(self.status) if not st.value]} never joined")
            time.sleep(0.05)

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
        self.wait_ready()
        payload = pickle.dumps((fn, args, kwargs))
        for q in self.tasks:
            q.put(payload)
        done: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(done) + len(errors) < self.size:
            remaining = deadline - time.monotonic()
            if errors:  # the others are probably stuck in a collective with the failed rank
                remaining = min(remaining, 5.0)
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead and not errors:
                errors.update({r: f"rank {r} process died (exit code {self.procs[r].exitcode})" for r in dead})
            try:
                rank, ok, data = self.results.get(timeout=max(0.05, min(remaining, 1.0)))
            except queue.Empty:
                if time.monotonic() >= deadline or (errors and remaining <= 0.05):
                    break
                continue
            if ok:
                done[rank] = pickle.loads(data)
            else:
                errors[rank] = data
        if errors or len(done) < self.size:
            stuck = [r for r in range(self.size) if r not in done and r not in errors]
            lines = [f"rank {r} raised:\n{tb}" for r, tb in sorted(errors.items())]
            lines += [f"rank {r} still running after {timeout:.0f}s, last collective: "
                      f"{self.status[r].value.decode(errors='replace')}" for r in stuck]
            self.close()
            head = f"{fn.__name__} failed on {self.size} ranks" if errors else \
                f"{fn.__name__} timed out after {timeout:.0f}s on {self.size} ranks"
            raise WorldError(head + "\n" + "\n".join(lines))
        return [done[r] for r in range(self.size)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        self.store = None


class WorldPool:
    """Keeps one World per (size, backend) alive across calls."""

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend
        self.worlds: dict[tuple[int, str], World] = {}

    def _backend_for(self, size: int) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= size else "gloo"

    def run(self, size: int, fn: Callable, *args: Any, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any) -> list:
        backend = self._backend_for(size)
        key = (size, backend)
        world = self.worlds.get(key)
        if world is None or not world.alive:
            world = self.worlds[key] = World(size, backend)
        try:
            return world.run(fn, args, kwargs, timeout)
        except WorldError:
            self.worlds.pop(key, None)
            raise

    def release_groups(self) -> None:
        """Every live world destroys its cached contexts' process groups and keeps only its default group:
        between test modules, so idle worlds poll fewer sockets while the next module runs (IDLE_NOTE)."""
        for key, world in list(self.worlds.items()):
            try:
                world.run(_drop_contexts, (), {}, DEFAULT_TIMEOUT)
            except WorldError:   # (closed by run): the next call on this size starts a fresh world
                self.worlds.pop(key)

    def close(self) -> None:
        for w in self.worlds.values():
            for q in w.tasks:
                q.put(None)
            w.close()
        self.worlds.clear()


def _drop_contexts(worker: Worker) -> None:
    worker.trim_contexts(0)


# ----------------------------------------------------------------------------- pytest plugin

def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--multirank-timeout", type=float, default=DEFAULT_TIMEOUT,
                     help="seconds a multirank call may run before it fails naming each stuck rank's last "
                          f"collective (default {DEFAULT_TIMEOUT:.0f})")


def pytest_configure(config: pytest.Config) -> None:
    if not torch.cuda.is_available():
        # parallel3d's Triton kernels run on CPU through the interpreter; set before any kernel module import
        os.environ.setdefault("TRITON_INTERPRET", "1")
    config.addinivalue_line("markers", "gpu: needs one CUDA GPU (skipped without)")
    config.addinivalue_line("markers", "multigpu: needs several CUDA GPUs (skipped with fewer than 2)")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    n_gpu = torch.cuda.device_count()
    for item in items:
        if "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs at least 2 CUDA GPUs"))


_POOL = pytest.StashKey[WorldPool]()


@pytest.fixture(scope="session")
def world_pool(request: pytest.FixtureRequest) -> Any:
    """The session's spawned worlds (gloo, or NCCL with a GPU per rank): `world_pool.run(n, fn, *args)`."""
    pool = request.config.stash[_POOL] = WorldPool()
    yield pool
    pool.close()


@pytest.fixture(scope="module", autouse=True)
def _worlds_release_groups_after_each_module(request: pytest.FixtureRequest) -> Any:
    """After a test module, the session's worlds (if any) keep only their default groups (IDLE_NOTE)."""
    yield
    pool = request.config.stash.get(_POOL, None)
    if pool is not None:
        pool.release_groups()


@pytest.fixture
def multirank(world_pool: WorldPool, request: pytest.FixtureRequest) -> Callable:
    """`multirank(fn, world_size=2, *args, timeout=None, **kwargs)`: fn(worker, *args, **kwargs) on
    `world_size` ranks; returns the list of results by rank, or fails naming the rank and its operation."""
    default = request.config.getoption("--multirank-timeout", DEFAULT_TIMEOUT)

    def run(fn: Callable, world_size: int = 2, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> list:
        return world_pool.run(world_size, fn, *args, timeout=timeout or default, **kwargs)
    return run
