"""The built wheel installs models/ and kernels/ only as parallel3d.models and parallel3d.kernels (no
top-level `models` or `kernels` package to collide with others of those names, e.g. Hugging Face's
`kernels`), and registers the multi-rank pytest plugin."""
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_has_models_and_kernels_under_parallel3d_only(tmp_path):
    src = tmp_path / "src"  # build from a copy: the build's scratch files stay out of the checkout
    src.mkdir()
    shutil.copy(ROOT / "setup.py", src)
    for name in ("parallel3d", "models", "kernels"):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "dist").glob("parallel3d-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"parallel3d"}, top
    for package in ("models", "kernels"):
        sources = sorted(p.name for p in (ROOT / package).glob("*.py"))
        packaged = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith(f"parallel3d/{package}/")
                          and n.count("/") == 2 and n.endswith(".py"))
        assert sources and packaged == sources, (package, sources, packaged)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "[pytest11]\nparallel3d.testing = parallel3d.testing" in zipfile.ZipFile(wheel).read(entry_points).decode()
