"""Test setup. The multi-rank harness, the gpu/multigpu markers and TRITON_INTERPRET on CPU come from the
parallel3d.testing pytest plugin (loaded by pytest.ini's `-p parallel3d.testing`, as a user's suite loads it)."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU through the interpreter; must precede any kernel module import.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser) -> None:
    parser.addoption("--full-sweep", action="store_true", default=False,
                     help="test_sweep: the full product of options instead of the pairwise subset (make sweep)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: slow test (still run in CI)")
    config.addinivalue_line("markers", "sweep: a heavy case another CI case covers; runs under --full-sweep "
                                       "(make sweep) only, to keep CI inside its 15 minutes")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if config.getoption("--full-sweep"):
        return
    skip = pytest.mark.skip(reason="a sweep case: make sweep (pytest --full-sweep) runs it")
    for item in items:
        if "sweep" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def worlds(world_pool):
    """Spawned gloo (or NCCL) worlds reused across the whole session: `worlds.run(n, fn, *args)`."""
    return world_pool
