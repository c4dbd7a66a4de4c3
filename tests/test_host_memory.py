"""CPU runs keep freed host memory for reuse (parallel3d/host_memory.py): without it glibc hands large
freed blocks back to the kernel and the next allocation faults them in again."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel3d.testing import agent_store_env, hosted_store

ROOT = Path(__file__).resolve().parents[1]
ROUNDS, STEPS = 5, 5
PROGRAM = """
import ctypes, os, resource, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, os.path.join({root!r}, "launch"))
import torch
from common import build_context, stage_builder
from parallel3d.mesh import ParallelContext
from parallel3d.models.config import ModelConfig
from parallel3d.training.config import load_config
from parallel3d.training.trainer import Trainer
from parallel3d.training.validate import resolve_and_validate

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

over = ["model.hidden_size=256", "model.ffn_hidden_size=768", "model.num_heads=4", "model.num_kv_heads=4",
        "model.num_layers=2", "model.vocab_size=8192", "train.seq_len=128", "model.max_seq_len=128",
        "train.micro_batch_size=4", "train.global_batch_size=8", "parallel.tp=1", "train.precision=fp32"]
cfg = resolve_and_validate(load_config(os.path.join({root!r}, "configs/tiny.yaml"), over, ModelConfig), 1)
# the launch scripts' context (a one-rank gloo world), or a bare one that skips what they set
ctx = build_context(cfg) if sys.argv[1] == "launch" else ParallelContext.single(torch.device("cpu"))
torch.set_num_threads(1)

# Freed blocks at the top of the heap, past glibc's default trim threshold (twice the largest block freed
# so far, here 60 MiB): three 30 MiB blocks, touched and freed top first, as a step frees its activations.
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes, libc.memset.argtypes = (ctypes.c_void_p,), (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t)
per_round = []
for _ in range({rounds} + 1):
    before = faults()
    blocks = [libc.malloc(30 << 20) for _ in range(3)]
    for block in blocks:
        libc.memset(block, 1, 30 << 20)
    for block in reversed(blocks):
        libc.free(block)
    per_round.append(faults() - before)
print("blocks", sorted(per_round[1:])[{rounds} // 2])

if sys.argv[1] == "launch":
    trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx))
    for _ in range(2):
        trainer.train_step()
    per_step = []
    for _ in range({steps}):
        before = faults()
        trainer.train_step()
        per_step.append(faults() - before)
    print("step", sorted(per_step)[{steps} // 2])
"""


def _faults(mode: str) -> dict[str, int]:
    """The median page faults of a round of the three blocks (after the first round) and, launched, of one
    training step (after two warm-up steps). glibc's own settings are kept out: bare is glibc's default."""
    store = hosted_store(1)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("MALLOC_") and key != "GLIBC_TUNABLES"}
    env.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                **agent_store_env(store), "OMP_NUM_THREADS": "1"})
    program = PROGRAM.format(root=str(ROOT), rounds=ROUNDS, steps=STEPS)
    out = subprocess.run([sys.executable, "-c", program, mode], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return {line.split()[0]: int(line.split()[1]) for line in out.stdout.splitlines() if line[:5] in ("block", "step ")}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cpu_runs_reuse_freed_memory_instead_of_faulting_it_in_again():
    """Blocks freed at the top of the heap: glibc trims them and the next round faults 60 MiB in again
    (15,328 faults with 4 KiB pages; a few dozen where the heap gets 2 MiB pages); none through the launch
    scripts' context. And a training step of a small Llama through that context takes next to no faults.

    The step's faults are a bound, not a comparison: how many a bare step takes depends on the kernel and
    on where glibc's sliding thresholds have got to (30,000-50,000 a step on this VM with transparent huge
    pages on madvise; 1 on a CI machine), and a step under load takes some hundreds for code pages the
    kernel reclaimed (DAMON's pageout scheme runs here). A step that allocated a block past the 32 MiB
    mmap threshold would take at least 8,192."""
    bare, launched = _faults("bare"), _faults("launch")
    assert bare["blocks"] >= 20, bare
    assert launched["blocks"] <= 2, (launched, bare)
    assert launched["step"] <= 2_000, launched
