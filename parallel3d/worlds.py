"""Spawned worlds of ranks for multi-rank tests, reused across calls (the parent's side; each rank runs
parallel3d/world_rank.py). parallel3d.testing documents them and serves them to pytest."""
from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.util  # noqa: F401  (its exit handler registered before ours: see _resume_paused_worlds)
import os
import pickle
import queue
import signal
import sys
import time
import weakref
from typing import Any, Callable

import torch

from parallel3d.world_rank import CAN_PAUSE, IDLE, STATUS_LEN, drop_contexts, hosted_store, worker_main

DEFAULT_TIMEOUT = 120.0
_PAUSED: "weakref.WeakSet[World]" = weakref.WeakSet()   # the stopped worlds (World.pause, World.resume)


@atexit.register   # registered after multiprocessing.util's exit handler (imported above), so it runs first
def _resume_paused_worlds() -> None:
    """At exit multiprocessing ends daemon ranks with SIGTERM and joins them: a stopped rank would take the
    SIGTERM only once continued, and the join would wait forever."""
    for world in list(_PAUSED):
        world.resume()


class WorldError(RuntimeError):
    """A rank raised, or the call timed out (message names the ranks and their last collective)."""

class World:
    """`size` spawned ranks with an initialised default group, waiting for tasks."""

    def __init__(self, size: int, backend: str) -> None:
        ctx = mp.get_context("spawn")
        self.size, self.backend = size, backend
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(size)]
        self.status = [ctx.Array("c", STATUS_LEN) for _ in range(size)]
        self.store = hosted_store(size)   # served here for the world's life
        port = self.store.port
        self.procs = [ctx.Process(target=worker_main, daemon=True,
                                  args=(r, size, port, backend, self.tasks[r], self.results, self.status[r],
                                        list(sys.path)))
                      for r in range(size)]
        for p in self.procs:
            p.start()

    def pause(self) -> None:
        """Stop (SIGSTOP) every rank between calls, once each has reported itself idle (so none holds its
        status line's lock). Each gloo process group keeps a thread that wakes every 10 ms even idle: a
        suite's idle worlds took 53 CPU-seconds of 1,900 on CI's two cores. gloo worlds only (NCCL's
        watchdog would read a resumed pause as a hang), and only where a rank dies with its parent
        (world_rank.CAN_PAUSE): a stopped rank cannot notice an orphaning itself."""
        if self in _PAUSED or self.backend != "gloo" or not CAN_PAUSE:
            return
        deadline, idle = time.monotonic() + 5.0, IDLE.encode()
        while not all(st.value == idle for st in self.status):
            if time.monotonic() > deadline:
                return   # a rank still reporting: leave the world running
            time.sleep(0.002)
        self._signal(signal.SIGSTOP)
        _PAUSED.add(self)

    def resume(self) -> None:
        if self in _PAUSED:
            self._signal(signal.SIGCONT)
            _PAUSED.discard(self)

    def _signal(self, sig: int) -> None:
        for p in self.procs:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:   # died: the next call finds it so
                pass

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
        for p in self.procs:   # (SIGKILL ends a stopped process too)
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)
        self.store = None


class WorldPool:
    """Keeps one World per (size, backend) alive across calls. `backend`: "gloo" (CPU ranks, the default,
    whatever GPUs the machine has: tests written for gloo stay on gloo on a GPU node), "nccl", or "auto"
    (NCCL with a GPU per rank where the machine has enough, else gloo). The pytest plugin sets "auto" for
    the duration of each test marked `gpu` or `multigpu`."""

    def __init__(self, backend: str = "gloo") -> None:
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
            return self._call(world, fn, args, kwargs, timeout)
        except WorldError:
            self.worlds.pop(key, None)
            raise

    @staticmethod
    def _call(world: World, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
        """One call on a world, which is stopped again after it (World.pause) until the next."""
        world.resume()
        out = world.run(fn, args, kwargs, timeout)   # (a failed call closes the world)
        world.pause()
        return out

    def release_groups(self) -> None:
        """Every live world destroys its cached contexts' process groups and keeps only its default group:
        between test modules, so idle worlds poll fewer sockets while the next module runs
        (world_rank.py, IDLE_NOTE)."""
        for key, world in list(self.worlds.items()):
            try:
                self._call(world, drop_contexts, (), {}, DEFAULT_TIMEOUT)
            except WorldError:   # (closed by run): the next call on this size starts a fresh world
                self.worlds.pop(key)

    def close(self) -> None:
        for w in self.worlds.values():
            w.resume()
            for q in w.tasks:
                q.put(None)
            w.close()
        self.worlds.clear()
