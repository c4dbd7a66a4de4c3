"""benchmarks/triton_wheel.py: a second Triton release for the ahead-of-time report, fetched once, unpacked
whole or not at all, imported first by the child process (the download itself is the sweep's device case)."""
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
triton_wheel = importlib.import_module("triton_wheel")


def test_an_unpacked_release_is_used_without_a_download(tmp_path, monkeypatch):
    (tmp_path / "3.6.0" / "triton").mkdir(parents=True)
    (tmp_path / "3.6.0" / "triton" / "__init__.py").write_text("")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("downloaded again"))
    assert triton_wheel.site("3.6.0", root=tmp_path) == tmp_path / "3.6.0"


def test_a_failed_download_names_the_release_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", "no index"))
    with pytest.raises(RuntimeError, match=r"triton==9\.9\.9.*no index"):
        triton_wheel.site("9.9.9", root=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_the_child_imports_that_release_first_with_its_own_kernel_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(triton_wheel, "site", lambda version: tmp_path / version)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    env = triton_wheel.child_env("3.6.0")
    assert env["PYTHONPATH"].split(":")[:2] == [str(tmp_path / "3.6.0"), str(triton_wheel.ROOT)]
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "3.6.0-kernel-cache")
    assert "TRITON_INTERPRET" not in env


def test_the_report_names_a_release_it_cannot_fetch(monkeypatch, capsys):
    """kernel_report.py --triton with a release pip cannot fetch: one error line naming it, exit status 2."""
    kernel_report = importlib.import_module("kernel_report")

    def no_release(version, root=None):
        raise RuntimeError(f"cannot download the triton=={version} wheel: no matching distribution")
    monkeypatch.setattr(triton_wheel, "site", no_release)
    assert kernel_report.main(["--triton", "0.0.1", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--triton 0.0.1" in err and "triton==0.0.1" in err


def test_the_interpreter_child_imports_the_numpy_that_release_needs_first(tmp_path, monkeypatch):
    fetched = []
    monkeypatch.setattr(triton_wheel, "site", lambda version: tmp_path / "triton" / version)
    monkeypatch.setattr(triton_wheel, "unpacked_wheel",
                        lambda package, version, root: fetched.append((package, version, root)) or root / version)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    env = triton_wheel.child_env("3.6.0", interpret=True)
    assert fetched == [("numpy", "2.3.5", tmp_path / "numpy")]
    assert env["PYTHONPATH"].split(":")[:3] == [str(tmp_path / "numpy" / "2.3.5"), str(tmp_path / "triton" / "3.6.0"),
                                                str(triton_wheel.ROOT)]
    assert env["TRITON_INTERPRET"] == "1"
    fetched.clear()
    assert triton_wheel.child_env("3.9.0", interpret=True)["PYTHONPATH"].split(":")[0] == str(tmp_path / "triton" / "3.9.0")
    assert fetched == []   # a release whose interpreter takes the installed numpy fetches none
