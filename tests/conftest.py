"""Test setup. TRITON_INTERPRET must be set before any Triton kernel module is imported (DESIGN.md 5)."""
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
    config.addinivalue_line("markers", "gpu: needs one CUDA GPU")
    config.addinivalue_line("markers", "multigpu: needs several CUDA GPUs")
    config.addinivalue_line("markers", "slow: slow test (still run in CI)")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    n_gpu = torch.cuda.device_count()
    for item in items:
        if "gpu" in item.keywords and n_gpu < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "multigpu" in item.keywords and n_gpu < 2:
            item.add_marker(pytest.mark.skip(reason="needs at least 2 CUDA GPUs"))


@pytest.fixture(scope="session")
def worlds():
    """Spawned gloo (or NCCL) worlds reused across the whole session: `worlds.run(n, fn, *args)`."""
    from parallel3d.testing import WorldPool

    pool = WorldPool()
    yield pool
    pool.close()
