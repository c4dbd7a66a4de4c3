"""What a GPU node changes for the test harness and the launcher (issue 48, defects 3 and 5).

Defect 3: the harness picked NCCL whenever the machine had enough GPUs, so the tests written for gloo (CPU
tensors, gloo's behaviour) ran on NCCL and failed on a GPU node; now every world is gloo unless the test is
marked gpu / multigpu (the plugin's `_worlds_backend_for_this_test`). Defect 5: parallel.gpus_per_node was
never checked against the launcher's ranks per node (LOCAL_WORLD_SIZE).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel3d.mesh_spec import check_node_size
from parallel3d.worlds import WorldPool

ROOT = Path(__file__).resolve().parents[1]


def test_worlds_stay_on_gloo_on_a_gpu_node(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    pool = WorldPool()
    assert pool._backend_for(4) == "gloo"
    pool.backend = "auto"            # what the plugin sets for a test marked gpu / multigpu
    assert pool._backend_for(4) == "nccl" and pool._backend_for(16) == "gloo"


def test_unmarked_tests_get_gloo_worlds(world_pool):
    assert world_pool.backend == "gloo"


@pytest.mark.multigpu
def test_marked_tests_get_nccl_worlds(world_pool):
    assert world_pool.backend == "auto" and world_pool._backend_for(2) == "nccl"


@pytest.mark.parametrize("gpn, world, local, ok", [
    (8, 16, 8, True), (4, 16, 8, True), (8, 4, 4, True),     # equal; a sub-node domain; one node holds all
    (8, 16, 4, False), (3, 16, 8, False)])                   # a mesh node across machines
def test_gpus_per_node_must_fit_the_launchers_nodes(gpn, world, local, ok):
    if ok:
        check_node_size(gpn, world, local)
    else:
        with pytest.raises(ValueError, match=f"gpus_per_node={gpn}.*LOCAL_WORLD_SIZE"):
            check_node_size(gpn, world, local)


def test_pretrain_refuses_gpus_per_node_against_the_launcher_before_any_group():
    env = {**os.environ, "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}
    proc = subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=2",
                           "parallel.gpus_per_node=8"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "parallel.gpus_per_node=8" in proc.stderr and "LOCAL_WORLD_SIZE" in proc.stderr
