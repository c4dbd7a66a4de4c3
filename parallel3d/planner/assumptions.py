"""What a plan assumes where the run will differ, said in the plan (`Plan.notes`, plan.py's `note:` lines):
the stand-in cannot run torch.compile's fused kernels, has no document boundaries or routing values to
follow, and prices attention at a measured rate only where one was measured (docs/planner.md, "Known
simplifications")."""
from __future__ import annotations

import copy
from typing import Optional

from parallel3d.planner.hardware import GPU
from parallel3d.training.config import ExperimentConfig


COMPILE_NOTE = ("train.compile=true is planned as the eager step: torch.compile's fusion of element-wise ops "
                "(fewer kernels, less memory traffic) and its partitioner's choice of saved activations are not "
                "modelled, so compute time and activation memory are the eager code's")
DOCUMENTS_NOTE = ("data.document_masking=true is planned as plain causal attention over the whole sequence: "
                  "attention time is an upper bound (a run's documents set what each kernel skips)")
ROUTING_NOTE = ("the dropless MoE is planned with balanced routing; a run's busiest EP rank usually takes more "
                "(plan.py --compare reads its load from the run's JSONL, --moe-load F plans at it)")


def attention_note(gpu: GPU) -> str:
    """On a GPU whose attention kernels were never measured (hardware.GPU.attention_efficiency unset)."""
    return (f"attention on {gpu.name} is priced at the matmul's efficiency ({gpu.matmul_efficiency:g} of the "
            f"peak): no attention kernel was measured on it (hardware.HOPPER_ATTENTION covers H100 and H200)")


def notes(cfg: ExperimentConfig, expert_load: float, gpu: Optional[GPU] = None) -> list[str]:
    """What the plan assumes where the run will differ (Plan.notes; docs/planner.md, "Known simplifications")."""
    m = cfg.model
    found = []
    if gpu is not None and not (gpu.runs_cpu_kernels or gpu.matmul_curves or gpu.attention_efficiency):
        found.append(attention_note(gpu))
    if cfg.train.compile:
        found.append(COMPILE_NOTE)
    if cfg.data.document_masking:
        found.append(DOCUMENTS_NOTE)
    if m.num_experts and cfg.parallel.ep > 1 and m.capacity_factor <= 0 and expert_load == 1.0:  # dropless
        found.append(ROUTING_NOTE)
    return found


def eager(cfg: ExperimentConfig) -> ExperimentConfig:
    """The layout without `train.compile`: the stand-in steps the eager blocks, and the plan says so
    (COMPILE_NOTE). Compiled blocks on the stand-in had run the same ops eagerly, only slower: tiny's plan took
    9 s against 5, to the same figures."""
    if not cfg.train.compile:
        return cfg
    run = copy.deepcopy(cfg)
    run.train.compile = False
    return run
