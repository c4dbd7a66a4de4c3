"""Fault tolerance: a rank killed under torchrun --max-restarts resumes from the newest complete checkpoint,
non-finite losses are skipped or stop the run, and a hung collective ends with an error naming it."""
from __future__ import annotations

import contextlib
import io
import json
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RUN = ["model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64", "model.kernels=torch",
       "train.seq_len=64", "train.global_batch_size=4", "train.micro_batch_size=1", "train.warmup_steps=1",
       "train.steps=30", "parallel.tp=1", "log.interval=100", "checkpoint.interval=3", "checkpoint.keep=2"]


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    return env


def _torchrun(tmp: Path, name: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "--monitor-interval=0.1", "launch/pretrain.py", "--config", "configs/tiny.yaml", *RUN,
           f"checkpoint.save_dir={tmp / name}", f"log.jsonl={tmp / (name + '.jsonl')}"]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@contextlib.contextmanager
def _reaped(proc: subprocess.Popen):
    """Kill torchrun and its workers (one process group) if the test fails while they run."""
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _workers(pid: int) -> list[int]:
    """The training processes torchrun started (its children running pretrain.py)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            kids += [int(k) for k in (task / "children").read_text().split()]
    return [k for k in kids if "pretrain.py" in Path(f"/proc/{k}/cmdline").read_text(errors="replace")]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def test_killed_rank_restarts_and_resumes(tmp_path):
    with _reaped(_torchrun(tmp_path, "ref")) as reference:
        out, _ = reference.communicate(timeout=120)
    assert reference.returncode == 0, out[-3000:]
    with _reaped(_torchrun(tmp_path, "run")) as proc:
        deadline = time.monotonic() + 90
        while not (tmp_path / "run" / "latest").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        victims = _workers(proc.pid)
        assert victims and proc.poll() is None, "training ended before a checkpoint appeared"
        os.kill(victims[-1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "after restart 1" in out, out[-3000:]
    records, ref = _records(tmp_path / "run.jsonl"), _records(tmp_path / "ref.jsonl")
    resumed_at = int(out.split("after restart 1")[0].rsplit("at step ", 1)[1].split()[0])
    assert resumed_at < 30, "the kill came after training had finished"
    assert [r["step"] for r in records[resumed_at - 30:]] == list(range(resumed_at + 1, 31))  # the restart's
    assert records[-1]["step"] == ref[-1]["step"] == 30
    assert records[-1]["loss"] == ref[-1]["loss"]
    final = {r["step"]: r["loss"] for r in records}  # the resumed attempt's values (logged last)
    assert all(final[r["step"]] == r["loss"] for r in ref)


def _nan_worker(worker, policy: str):
    from ckpt_helpers import build_trainer, context_for, make_config
    from parallel3d.training.trainer import NonFiniteError

    torch.set_num_threads(1)
    cfg = make_config([f"train.nan_policy={policy}"], worker.world_size)
    trainer = build_trainer(cfg, context_for(cfg, worker))
    trainer.train_step()
    weight = trainer.chunks[0].layers["0"].mlp.up_proj.weight
    before = [p.detach().clone() for p in trainer.chunks[0].parameters()]
    saved = weight.detach().clone()
    if worker.rank == 1:  # the test-only fault: one rank's weight goes bad
        with torch.no_grad():
            weight[0, 0] = float("nan")
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            out = trainer.train_step()
    except NonFiniteError as e:
        return {"error": str(e)}
    unchanged = all(torch.equal(a, p.detach()) or a is saved
                    for a, p in zip(before, trainer.chunks[0].parameters()) if p is not weight)
    with torch.no_grad():
        weight.copy_(saved)
    after = trainer.train_step()
    return {"skipped": out["skipped"], "loss": out["loss"], "log": log.getvalue(), "unchanged": unchanged,
            "step": trainer.step, "next_loss": after["loss"]}


def test_nan_step_is_skipped(worlds):
    for rank, r in enumerate(worlds.run(2, _nan_worker, "skip")):
        assert r["skipped"] and math.isnan(r["loss"]) and r["unchanged"], r
        assert f"[rank {rank}] step 1: non-finite" in r["log"] and "skipped" in r["log"]
        assert math.isfinite(r["next_loss"]) and r["step"] == 3


def test_nan_stops_the_run(worlds):
    for rank, r in enumerate(worlds.run(2, _nan_worker, "stop")):
        assert "step 1" in r["error"] and f"rank {rank}" in r["error"] and "nan_policy=stop" in r["error"]


def _hang_worker(rank: int, store_env: dict, results, release) -> None:
    """Start-up exactly as launch/pretrain.py does it (config -> build_context), with parallel.timeout_s=3."""
    sys.path.insert(0, str(ROOT / "launch"))
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", **store_env)
    from common import build_context, load_and_validate

    from parallel3d import comm

    cfg = load_and_validate(str(ROOT / "configs/tiny.yaml"), ["parallel.tp=1", "parallel.timeout_s=3"])
    ctx = build_context(cfg)
    start = time.monotonic()
    try:
        if rank == 0:  # rank 1 never joins this all-reduce
            comm.all_reduce(torch.ones(4), ctx.dp)
            results.put((rank, "no error", 0.0))
        else:
            results.put((rank, "skipped", 0.0))
    except comm.CollectiveError as e:
        results.put((rank, f"CollectiveError: {e}", time.monotonic() - start))
    if rank == 1:
        release.wait(60)  # stay alive so rank 0 sees a timeout, not a closed connection
    else:
        release.set()


def test_hung_collective_ends_within_parallel_timeout_s():
    """parallel.timeout_s (default 600 s) reaches the process groups: with 3 s, a peer that never joins an
    all-reduce ends it within seconds, with an error naming the operation and group."""
    from parallel3d.testing import agent_store_env, hosted_store

    ctx = mp.get_context("spawn")
    results, release = ctx.Queue(), ctx.Event()
    store = hosted_store(2)
    procs = [ctx.Process(target=_hang_worker, args=(r, agent_store_env(store), results, release), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = {r: (msg, waited) for r, msg, waited in (results.get(timeout=90) for _ in range(2))}
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    msg, waited = got[0]
    assert msg.startswith("CollectiveError") and "all_reduce" in msg and "dp group" in msg, got
    assert waited < 60, f"the 3 s timeout was not applied (waited {waited:.0f} s; the default is 600 s)"
