"""Run a function on N ranks from pytest, reusing spawned worlds across tests.

    pool = WorldPool()                       # one per test session (tests/conftest.py fixture `worlds`)
    results = pool.run(4, fn, arg1, arg2)    # fn(worker, arg1, arg2) runs on 4 ranks; list of returns

`fn` must be a module-level function. It receives a `Worker` (rank, world_size, device and
`worker.context(spec)`, which builds a `ParallelContext` once per mesh and reuses it). Worlds stay alive
between calls, since spawning 8 ranks costs seconds. A call that exceeds its timeout fails with each
stuck rank and the last collective it entered; a rank that raises fails the call with its traceback.
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
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

_STATUS_LEN = 512


class WorldError(RuntimeError):
    """A rank raised, or the call timed out (message names the ranks and their last collective)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Worker:
    """What a distributed test function sees on its rank."""
    rank: int
    world_size: int
    device: torch.device
    status: Any  # shared char array: the last collective entered (read by the parent on timeout)
    _contexts: dict = field(default_factory=dict)

    def context(self, spec: Any) -> Any:
        """The ParallelContext of `spec` on this world (built once per spec, stats reset every call)."""
        from parallel3d.mesh import ParallelContext

        if spec not in self._contexts:
            ctx = ParallelContext.build(spec, device=self.device)
            ctx.stats.on_op = self.report
            self._contexts[spec] = ctx
        ctx = self._contexts[spec]
        ctx.stats.reset()
        return ctx

    def report(self, what: str) -> None:
        data = what.encode()[: _STATUS_LEN - 1]
        self.status.value = data


def _worker_main(rank: int, size: int, port: int, backend: str, tasks: Any, results: Any, status: Any,
                 sys_path: list[str]) -> None:
    sys.path[:] = sys_path
    if backend == "gloo":  # CPU ranks run Triton kernels through the interpreter (DESIGN.md 5)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=600))
    worker = Worker(rank, size, device, status)
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
        port = _free_port()
        self.procs = [ctx.Process(target=_worker_main, daemon=True,
                                  args=(r, size, port, backend, self.tasks[r], self.results, self.status[r],
                                        list(sys.path)))
                      for r in range(size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
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


class WorldPool:
    """Keeps one World per (size, backend) alive across calls."""

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend
        self.worlds: dict[tuple[int, str], World] = {}

    def _backend_for(self, size: int) -> str:
        if self.backend != "auto":
            return self.backend
        return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= size else "gloo"

    def run(self, size: int, fn: Callable, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list:
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

    def close(self) -> None:
        for w in self.worlds.values():
            for q in w.tasks:
                q.put(None)
            w.close()
        self.worlds.clear()
