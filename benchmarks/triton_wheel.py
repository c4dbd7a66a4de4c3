"""Another Triton release beside the installed one, for the ahead-of-time report (no GPU, no install).

    python benchmarks/kernel_report.py --triton 3.6.0 --arch 80 90 --quick

Why: what a GPU runs is compiled by the Triton its torch ships with, and register allocation differs between
releases by tens of registers per kernel. The H200 image of the GPU sessions has torch 2.11.0+cu130 with
Triton 3.6.0 (benchmarks/RESULTS.md), while CI compiles with the pinned 3.9.0 (constraints.txt); a tile
free of stack under one may keep 100 B of it under the other. So the report can compile under a second
release: its wheel is downloaded once from the package index (`pip download --no-deps`, about 190 MB) and
unpacked, never installed, under .cache/triton/<version>; the report reruns in a child process with that
directory first on PYTHONPATH and a Triton cache of its own (compiled kernels of two releases never mix).
The wheel ships its own ptxas and cuobjdump, so the report reads the cubins with that release's tools.

The interpreter parity tests run under that release too (tests/test_device_triton.py: `child_env(version,
interpret=True)`). Triton 3.6's interpreter turns one-element arrays into Python scalars in a way numpy 2.4
refuses ("only 0-dimensional arrays can be converted"), so its child imports the numpy release named in
INTERPRETER_NUMPY first, fetched and unpacked the same way (about 17 MB).
"""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The Triton of the GPU sessions' image (torch 2.11.0+cu130; RESULTS.md, "First GPU session"): the release
# the tile measurements were taken with, so the one whose compile a tile table must also hold for.
DEVICE_TRITON = "3.6.0"
# the numpy a Triton release's interpreter needs, where the installed one (constraints.txt) is too new for it
INTERPRETER_NUMPY = {"3.6.0": "2.3.5"}


def site(version: str, root: Path = ROOT / ".cache" / "triton") -> Path:
    """The directory holding the unpacked `triton` package of `version`, fetched on first use."""
    return unpacked_wheel("triton", version, root)


def unpacked_wheel(package: str, version: str, root: Path) -> Path:
    """root/version holding the unpacked wheel of `package==version` for this interpreter, fetched on first
    use. The unpacked tree is moved into place whole, so an interrupted fetch leaves nothing half-written."""
    target = root / version
    if (target / package / "__init__.py").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", f"{package}=={version}", "--no-deps",
                               "--only-binary", ":all:", "-d", tmp, "-q"], capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob(f"{package}-*.whl"))
        if proc.returncode or not wheels:
            raise RuntimeError(f"cannot download the {package}=={version} wheel: {proc.stderr.strip()[-500:]}")
        unpacked = Path(tmp) / "site"
        shutil.unpack_archive(str(wheels[0]), str(unpacked), format="zip")
        tools = unpacked / "triton" / "backends" / "nvidia" / "bin"
        for tool in tools.glob("*"):  # zip archives keep no permission bits (Triton's ptxas, cuobjdump)
            tool.chmod(tool.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        os.replace(unpacked, target)
    return target


def child_env(version: str, interpret: bool = False) -> dict[str, str]:
    """The environment of a child process that imports Triton `version` (and this checkout) first: to
    compile (TRITON_INTERPRET unset) or, with `interpret`, to run kernels in its interpreter (with the numpy
    that interpreter needs first of all, INTERPRETER_NUMPY)."""
    here = site(version)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    paths = [str(here), str(ROOT)]
    if interpret:
        env["TRITON_INTERPRET"] = "1"
        if version in INTERPRETER_NUMPY:
            paths.insert(0, str(unpacked_wheel("numpy", INTERPRETER_NUMPY[version], here.parent.parent / "numpy")))
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [env.get("PYTHONPATH")])])
    env["TRITON_CACHE_DIR"] = str(here.parent / f"{version}-kernel-cache")
    return env


def rerun_under(version: str, script: Path, argv: list[str]) -> int:
    """Run `script argv` in a child process under Triton `version`; its exit status."""
    return subprocess.run([sys.executable, str(script), *argv], env=child_env(version), cwd=ROOT).returncode
