"""The kernels' interpreter parity under the Triton release the GPU sessions run (triton_wheel.DEVICE_TRITON),
not only under CI's pinned one: the same test files, rerun in a child process that imports that release
(and the numpy its interpreter needs) first. The ahead-of-time compile under it is test_kernel_budget's
`device` case. CI runs the attention kernels at every tile shape (forward, dK/dV, dQ; packed documents, GQA,
ring blocks, TMA loads, the key-rows form: the kernels the GPU checks time first); the sweep runs every
kernel test file."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
triton_wheel = importlib.import_module("triton_wheel")

ATTENTION = ["tests/test_attention_tile_shapes.py"]
EVERY_KERNEL = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_kernels_*.py")) + [
    "tests/test_attention_tile_shapes.py", "tests/test_kernel_ops.py", "tests/test_fp8_casts.py"]


@pytest.mark.parametrize("files", [ATTENTION, pytest.param(EVERY_KERNEL, marks=pytest.mark.sweep)],
                         ids=["attention", "every-kernel"])
def test_interpreter_parity_under_the_device_release(files):
    try:
        env = triton_wheel.child_env(triton_wheel.DEVICE_TRITON, interpret=True)
    except RuntimeError as e:   # no package index in reach: say so rather than fail
        pytest.skip(str(e))
    probe = subprocess.run([sys.executable, "-c", "import numpy, triton; print(triton.__version__, numpy.__version__)"],
                           env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert probe.stdout.split()[0] == triton_wheel.DEVICE_TRITON, probe.stdout
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", *files], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout.splitlines()[-1], proc.stdout[-500:]
