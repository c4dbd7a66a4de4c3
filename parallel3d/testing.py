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

Backend: gloo, on CPU, for every test, also on a machine with GPUs (a test written for gloo keeps its CPU
tensors and gloo's behaviour). A test marked `gpu` or `multigpu` runs its worlds with NCCL, one rank per GPU
(`backend="auto"`: NCCL where the machine has a GPU for every rank), and builds on `worker.device`, the
rank's GPU.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

import pytest
import torch

from parallel3d.world_rank import CACHED_CONTEXTS, Worker, agent_store_env, client_store, hosted_store  # noqa: F401
from parallel3d.worlds import DEFAULT_TIMEOUT, World, WorldError, WorldPool  # noqa: F401


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
    """After a test module, the session's worlds (if any) keep only their default groups (world_rank.py, IDLE_NOTE)."""
    yield
    pool = request.config.stash.get(_POOL, None)
    if pool is not None:
        pool.release_groups()


@pytest.fixture(autouse=True)
def _worlds_backend_for_this_test(request: pytest.FixtureRequest) -> Any:
    """gloo for every test; NCCL ("auto") for the duration of a test marked gpu or multigpu."""
    pool = request.config.stash.get(_POOL, None)   # (session fixtures a test uses are built before this)
    if pool is None:
        yield
        return
    marked = any(request.node.get_closest_marker(m) is not None for m in ("gpu", "multigpu"))
    pool.backend = "auto" if marked else "gloo"
    yield
    pool.backend = "gloo"


@pytest.fixture
def multirank(world_pool: WorldPool, request: pytest.FixtureRequest) -> Callable:
    """`multirank(fn, world_size=2, *args, timeout=None, **kwargs)`: fn(worker, *args, **kwargs) on
    `world_size` ranks; returns the list of results by rank, or fails naming the rank and its operation."""
    default = request.config.getoption("--multirank-timeout", DEFAULT_TIMEOUT)

    def run(fn: Callable, world_size: int = 2, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> list:
        return world_pool.run(world_size, fn, *args, timeout=timeout or default, **kwargs)
    return run
