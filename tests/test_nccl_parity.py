"""NCCL parity, one test per dimension (issue 48, item 4): on a machine with GPUs, each layout trains through
the real Trainer and DistributedOptimizer over NCCL, one rank per GPU, and matches world size 1 on one GPU
(loss per step, every rank's logged grad_norm, the fp32 master weights after the steps: tests/test_sweep's
check). Skipped without enough GPUs; on CPU the same layouts run on the strict backend
(tests/test_strict_backend.py) and in the sweep."""
from __future__ import annotations

import pytest

from test_strict_backend import MOE, _reference, _train
from test_sweep import check

LAYOUTS = {
    "dp-zero0": (2, ["parallel.dp=2", "parallel.zero=0"]),
    "dp-zero1-overlap": (2, ["parallel.dp=2", "parallel.zero=1", "parallel.overlap_param_gather=true"]),
    "dp-zero2": (2, ["parallel.dp=2", "parallel.zero=2"]),
    "dp-zero3": (2, ["parallel.dp=2", "parallel.zero=3"]),
    "hsdp": (4, ["parallel.dp=4", "parallel.dp_shard=2", "parallel.zero=2"]),
    "offload": (2, ["parallel.dp=2", "parallel.zero=1", "parallel.offload_optimizer=cpu"]),
    "tp-sp": (2, ["parallel.tp=2", "parallel.sp=true"]),
    "pp-1f1b": (2, ["parallel.pp=2", "parallel.schedule=1f1b"]),
    "cp-ring": (2, ["parallel.cp=2", "parallel.cp_mode=ring"]),
    "ep-eq-dp": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.zero=1", *MOE]),
}


def _single_gpu_reference(overrides, world):
    return _train(None, [o for o in _reference(overrides) if not o.startswith(("parallel.tp", "parallel.sp",
                                                                                "parallel.pp", "parallel.cp"))],
                  world, device="cuda")


@pytest.mark.multigpu
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_nccl_layout_matches_world_size_1(multirank, name):
    import torch

    world, overrides = LAYOUTS[name]
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    got = multirank(_train, world, overrides, world, False)
    check({"precision": "fp32"}, got, _single_gpu_reference(overrides, world))
