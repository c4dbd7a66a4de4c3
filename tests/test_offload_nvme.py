"""NVMe offload: host memory stays within the buffer pool, the command line runs it, bad directories and a
full disk end with one clear message, and no file outlives the run."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpt_helpers import build_trainer, context_for, make_config
from parallel3d.offload import files as offload_files
from parallel3d.offload.files import OffloadError
from parallel3d.training.config import ConfigError

ROOT = Path(__file__).resolve().parent.parent

# ~34M parameters (two 1024-wide layers, 4096 FFN): fp32 master + m + v = 12 B/param ~ 400 MB of state
WIDE = ["model.hidden_size=1024", "model.ffn_hidden_size=4096", "model.num_heads=8", "model.num_kv_heads=8",
        "model.num_layers=2", "model.vocab_size=256", "train.seq_len=16", "train.global_batch_size=1",
        "parallel.zero=1", "train.precision=fp32"]

MEASURE = r"""
import json, os, sys
import torch
sys.path.insert(0, "tests")
from ckpt_helpers import build_trainer, context_for, make_config
torch.set_num_threads(1)

def rss():
    try:
        import psutil
        return psutil.Process().memory_info().rss
    except ImportError:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

cfg = make_config(json.loads(sys.argv[1]), 1)
trainer = build_trainer(cfg, context_for(cfg))
losses = [trainer.train_step()["loss"] for _ in range(2)]
n = sum(b.seg for b in trainer.optimizer.buckets)
raw = rss()
import ctypes
ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back: what is left is memory in use
print(json.dumps({"rss": raw, "rss_in_use": rss(), "losses": losses, "state_bytes": 12 * n}))
"""


def _measure(overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", MEASURE, json.dumps(overrides)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_nvme_resident_memory_stays_within_the_buffer_pool(tmp_path):
    """Resident memory of the same run with and without NVMe offload: the offloaded run holds the optimizer
    state only in its buffer pool, so it is smaller by the state bytes minus at most the pool."""
    pool_mb = 16
    plain = _measure(WIDE)
    off = _measure([*WIDE, "parallel.offload_optimizer=nvme", f"parallel.offload_dir={tmp_path}",
                    f"parallel.offload_buffer_mb={pool_mb}"])
    state = plain["state_bytes"]
    assert state > 350 * 2 ** 20
    # resident memory as it is (freed heap included: the offloaded step's transients may stay mapped)
    assert plain["rss"] - off["rss"] >= 0.6 * state, (plain["rss"] / 2 ** 20, off["rss"] / 2 ** 20, state / 2 ** 20)
    # memory in use: everything but the pool (and 24 MiB of slack) of the state bytes is gone from the process
    saved = plain["rss_in_use"] - off["rss_in_use"]
    assert saved >= state - (pool_mb + 24) * 2 ** 20, (saved / 2 ** 20, state / 2 ** 20)
    assert off["losses"] == plain["losses"]
    assert os.listdir(tmp_path) == []


def _cli(args, cwd=ROOT):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


CLI = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
       "model.ffn_hidden_size=64", "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1",
       "train.steps=3", "train.precision=fp32", "train.warmup_steps=1", "log.interval=1", "parallel.tp=1"]


def test_cli_nvme_logs_identical_losses(tmp_path):
    """pretrain.py with the state on NVMe logs the losses of the same config trained without offload (here
    in-process, through the same Trainer) and leaves no file behind."""
    from parallel3d.models.config import ModelConfig
    from parallel3d.training.config import load_config
    from parallel3d.training.validate import resolve_and_validate

    d = tmp_path / "nvme"
    d.mkdir()
    log = tmp_path / "nvme.jsonl"
    out = _cli([*CLI, "parallel.offload_optimizer=nvme", f"parallel.offload_dir={d}", f"log.jsonl={log}"])
    assert out.returncode == 0, out.stderr[-3000:]
    torch.set_num_threads(1)
    cfg = resolve_and_validate(load_config("configs/tiny.yaml", CLI, ModelConfig), 1)
    trainer = build_trainer(cfg, context_for(cfg))
    plain = [trainer.train_step()["loss"] for _ in range(cfg.train.steps)]
    assert len(plain) == 3 and [json.loads(line)["loss"] for line in open(log)] == plain
    assert os.listdir(d) == []  # removed at exit


@pytest.mark.parametrize("overrides,words", [
    (["parallel.offload_params=cpu", "parallel.zero=1"], "needs parallel.zero=3"),
    (["parallel.offload_optimizer=nvme"], "needs parallel.offload_dir"),
    (["parallel.offload_optimizer=nvme", "parallel.offload_dir=/nonexistent/dir"], "does not exist"),
    (["parallel.offload_optimizer=disk"], "is not one of none, cpu, nvme"),
    (["parallel.offload_optimizer=nvme", "parallel.offload_dir=/proc"], "not writable"),
    (["parallel.offload_optimizer=nvme", "parallel.offload_dir=/tmp", "parallel.offload_buffer_mb=0"], "> 0"),
])
def test_bad_offload_config_is_refused(overrides, words):
    with pytest.raises(ConfigError, match=words):
        make_config(overrides, 1)


def _trainer(overrides):
    torch.set_num_threads(1)
    cfg = make_config(overrides, 1)
    return build_trainer(cfg, context_for(cfg))


def test_full_directory_is_refused_up_front(tmp_path, monkeypatch):
    real = os.statvfs

    class Small:
        def __init__(self, st):
            self.f_frsize, self.f_bavail = st.f_frsize, (1 << 20) // st.f_frsize   # 1 MiB free
    monkeypatch.setattr(offload_files.os, "statvfs", lambda p: Small(real(p)))
    with pytest.raises(OffloadError, match=r"has 1\.0 MiB free but rank 0's offloaded state needs"):
        _trainer(["model.hidden_size=256", "parallel.offload_optimizer=nvme", f"parallel.offload_dir={tmp_path}"])
    assert os.listdir(tmp_path) == []


def test_disk_full_during_a_step_is_a_clear_error(tmp_path, monkeypatch):
    trainer = _trainer(["parallel.offload_optimizer=nvme", f"parallel.offload_dir={tmp_path}", "train.steps=2"])
    trainer.train_step()

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(offload_files.os, "pwrite", full)
    with pytest.raises(OffloadError, match="no space left on device while writing offloaded state"):
        trainer.train_step()
    monkeypatch.undo()
    trainer.optimizer.close()
    assert os.listdir(tmp_path) == []


def test_cli_removes_offload_files_when_terminated(tmp_path):
    """torchrun ends surviving workers with SIGTERM: the files go with them."""
    import signal
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    args = [*CLI, "train.steps=100000", "parallel.offload_optimizer=nvme", f"parallel.offload_dir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", *args],
                            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not os.listdir(tmp_path) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.1)
        assert os.listdir(tmp_path), "the run never created its offload files"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    assert os.listdir(tmp_path) == []

