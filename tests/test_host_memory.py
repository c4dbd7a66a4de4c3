"""CPU runs keep freed host memory for reuse (parallel3d/host_memory.py): without it glibc hands large
freed blocks back to the kernel and every training step faults them in again."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel3d.testing import agent_store_env, hosted_store

ROOT = Path(__file__).resolve().parents[1]
MEASURED_STEPS = 5
PROGRAM = """
import os, resource, sys
sys.path.insert(0, {root!r}); sys.path.insert(0, os.path.join({root!r}, "launch"))
import torch
from common import build_context, stage_builder
from parallel3d.mesh import ParallelContext
from parallel3d.models.config import ModelConfig
from parallel3d.training.config import load_config
from parallel3d.training.trainer import Trainer
from parallel3d.training.validate import resolve_and_validate

over = ["model.hidden_size=256", "model.ffn_hidden_size=768", "model.num_heads=4", "model.num_kv_heads=4",
        "model.num_layers=2", "model.vocab_size=8192", "train.seq_len=128", "model.max_seq_len=128",
        "train.micro_batch_size=4", "train.global_batch_size=8", "parallel.tp=1", "train.precision=fp32"]
cfg = resolve_and_validate(load_config(os.path.join({root!r}, "configs/tiny.yaml"), over, ModelConfig), 1)
# the launch scripts' context (a one-rank gloo world), or a bare one that skips what they set
ctx = build_context(cfg) if sys.argv[1] == "launch" else ParallelContext.single(torch.device("cpu"))
torch.set_num_threads(1)
trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx))
for _ in range(2):
    trainer.train_step()
per_step = []
for _ in range({steps}):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    trainer.train_step()
    per_step.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(per_step)[{steps} // 2])
"""


def _faults(mode: str) -> int:
    """The median page faults of one training step after two warm-up steps."""
    store = hosted_store(1)
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           **agent_store_env(store), "OMP_NUM_THREADS": "1"}
    program = PROGRAM.format(root=str(ROOT), steps=MEASURED_STEPS)
    out = subprocess.run([sys.executable, "-c", program, mode], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_cpu_runs_reuse_freed_memory_instead_of_faulting_it_in_again():
    """A training step of a small Llama: thousands of page faults without (glibc trims and unmaps the
    freed activations), next to none through the launch scripts' context.

    The median step, not a total: a step that grows the kept heap faults its new pages in once (about
    2,000 faults here, now and then), and how many faults the bare step takes depends on the kernel
    (30,000-50,000 a step on this VM with transparent huge pages on madvise, about 3,000 on a CI machine)."""
    bare, launched = _faults("bare"), _faults("launch")
    assert bare > 1_000, bare
    assert launched <= 50, (launched, bare)   # 0-2 here
