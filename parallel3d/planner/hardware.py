"""GPUs and links the planner knows: datasheet peaks plus the fraction of them real kernels reach.

Every number has a stated basis; none is fitted to a published MFU.

Peaks (dense, no sparsity), vendor datasheets:
  A100-SXM4-80GB: 312 TFLOP/s bf16/fp16, 156 tf32, 19.5 fp32, no fp8; HBM2e 2.039 TB/s; NVLink3 300 GB/s
                  per direction; InfiniBand HDR 200 Gb/s (25 GB/s) per GPU in DGX A100.
  H100-SXM5-80GB: 989 bf16, 1979 fp8, 494.5 tf32, 67 fp32; HBM3 3.35 TB/s; NVLink4 450 GB/s per direction;
                  NDR 400 Gb/s (50 GB/s) per GPU in DGX H100.
  H200-SXM-141GB: the H100 compute die with HBM3e 4.8 TB/s and 141 GB.
  B200-SXM-180GB (DGX B200): 2250 bf16, 4500 fp8, 1100 tf32 (dense); HBM3e 8 TB/s; NVLink5 900 GB/s per
                  direction; ConnectX-7 400 Gb/s (50 GB/s) per GPU.

Achievable fractions (the efficiencies), with their basis:
  matmul 0.75: large bf16 GEMMs in cuBLAS reach roughly 70-80% of the dense peak on A100/H100 (NVIDIA's
    published GEMM performance guides); attention on H100/H200 at its measured rates (HOPPER_ATTENTION:
    SDPA's kernels 0.58 forward and 0.45 backward, the cuDNN CP block 0.45 and 0.39, ours 0.33 and 0.25),
    on A100 and B200, where no attention
    was measured, at the matmul's 0.75 with our kernel's occupancy derate (planner/kernels.py);
  memory 0.85: STREAM-like copy kernels reach about 85-90% of HBM peak;
  NVLink 0.80 and InfiniBand 0.90 of the per-direction link bandwidth: nccl-tests' bus bandwidth for large
    all-reduces on DGX H100 (~360 of 450 GB/s) and across NDR (~45 of 50 GB/s);
  latency alpha: 10 us per collective step inside a node, 20 us across nodes (nccl-tests small-message
    latency is 10-30 us). PCIe Gen5 x16 (host offload) 64 GB/s nominal, 0.8 of it.
Host optimizer step (optimizer offload): the DistributedOptimizer's step over host state as the code runs
  it (unscale-and-check, norm, clipping, AdamW's exact torch arithmetic, not a vectorised CPU-Adam, and the
  16-bit copy it publishes) at the threads a rank gets: torchrun sets OMP_NUM_THREADS=1 and
  launch/common.py divides the threads by the local world size, so one thread per rank. Per thread,
  `HOST_STEP_PARAMS_PER_S_PER_THREAD`, measured by profile.host_step_rate (then over 64M parameters, now
  32M: larger than any cache, as an offloaded model's state is) on the H200's host (third GPU session,
  2026-11-27); it measures it again for `--gpu cpu` and for `planner_accuracy.py --gpu`. Pricing AdamW alone (0.3 G params/s there)
  had left the offloaded step 1.7x its plan.
Host issue time per op (GPUs only): the host's seconds to issue one op of the training step (Python,
  autograd, dispatch, launch), which the GPU's queue hides only while its kernels take longer
  (cost.queue_seconds). `HOST_OP_S` inside the pipeline's actions (66 us) and `HOST_STEP_OP_S` outside
  them (optimizer, clipping: 28 us), measured on the host of one H200 (16 cores, 2026-11-26; RESULTS.md
  "Second GPU session"): a 1B Llama's layout at width 128, too small to keep the GPU busy, its measured
  pipeline and the rest of its step over the ops the dry run counts in each. Another host or code path
  differs; `benchmarks/planner_accuracy.py --gpu` measures its own host first.
The peaks are parallel3d/hardware.py's table, which the run's MFU uses too. `--gpu cpu` is this machine,
measured (profile.py), with efficiencies 1 (the rates are achieved rates).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from parallel3d.hardware import PEAK_FLOPS

HOST_STEP_PARAMS_PER_S_PER_THREAD = 0.186e9
HOST_THREADS_PER_RANK = 1
HOST_OP_S = 66e-6
HOST_STEP_OP_S = 28e-6
# Flash attention's share of the dense bf16 peak on Hopper (sm_90), measured on one H200 (bf16, b2 s4096
# hq32 hk8 d128 causal; benchmarks/RESULTS.md): SDPA's kernels, what a CUDA run takes without the lse (the dry
# run's library_attention stand-in), 569 TFLOP/s forward and 447 backward (second GPU session); a
# context-parallel block with the lse, SDPA's cuDNN op with the kv heads expanded (library_lse_attention),
# 0.45 and 0.39 of the peak (third); ours, with the tiles it now takes, 329 and 247 TFLOP/s (second).
HOPPER_ATTENTION = {"library_attention_fwd": 569 / 989, "library_attention_bwd": 447 / 989,
                    "library_lse_attention_fwd": 0.45, "library_lse_attention_bwd": 0.39,
                    "flash_attention_fwd": 329 / 989, "flash_attention_bwd": 247 / 989}


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: dict          # dtype name -> dense FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float
    nvlink_bytes_per_s: float  # per direction, per GPU
    network_bytes_per_s: float  # inter-node, per GPU
    pcie_bytes_per_s: float = 64e9
    matmul_efficiency: float = 0.75
    memory_efficiency: float = 0.85
    nvlink_efficiency: float = 0.80
    network_efficiency: float = 0.90
    nvlink_latency_s: float = 10e-6
    network_latency_s: float = 20e-6
    sm_count: int = 132
    reserved_bytes: float = 2 * 2**30  # CUDA context, cuBLAS workspaces and NCCL channel buffers (~1-2 GiB)
    host_step_params_per_s: float = HOST_STEP_PARAMS_PER_S_PER_THREAD * HOST_THREADS_PER_RANK
    # seconds the host takes to issue one op (GPUs: the queue runs behind it, cost.queue_seconds) inside the
    # pipeline's actions (modules, autograd) and outside them (optimizer, clipping: plain calls); on a CPU
    # the ops run on the host itself and op_overhead_s below is their per-op cost instead
    host_op_s: float = HOST_OP_S
    host_step_op_s: float = HOST_STEP_OP_S
    # measured devices only (profile.py): seconds per matmul by FLOPs and dtype, per-op overhead, and
    # (alpha, beta) per collective op instead of the link's
    matmul_curves: Optional[dict] = None
    op_overhead_s: float = 0.0
    collectives: Optional[dict] = None
    # gloo on a shared CPU: what a collective costs on top of its (alpha, beta) when the rank
    # arrives from `comm_wake_gap_s` or more of compute (op -> seconds; profile_gloo.py); scaled down
    # linearly for shorter stretches (cost.wake_seconds)
    comm_wake_s: Optional[dict] = None
    comm_wake_gap_s: float = 0.0
    # this machine, measured op by op (planner/op_replay.py): the cache of replayed op times, and what
    # ranks computing at once multiply them by; ops it cannot replay fall back to the curves above
    op_times: Optional[Path] = None
    op_time_scale: float = 1.0
    # replayed ops read their inputs from cache; an input the step last touched more than `cache_bytes` of
    # traffic ago comes from memory instead, at `cold_s_per_byte` more (profile.py measures both)
    cache_bytes: float = 0.0
    cold_s_per_byte: float = 0.0
    # whether communication can run beside compute (a GPU's copy engines and NCCL's SMs; on a CPU, only
    # when a core is left over for gloo's threads: ranks >= cores share theirs with the compute)
    overlaps_comm: bool = True
    # where it cannot: op -> the share of a collective's time its threads keep a core busy, which a
    # collective started beside compute takes from it (the rest hides: cost.hidden_share; profile_gloo.py)
    comm_busy: Optional[dict] = None
    # attention ops' measured share of the dense peak (op name -> fraction) where measured on the GPU's
    # architecture: it stands in for matmul_efficiency and the occupancy derate (cost.op_time)
    attention_efficiency: Optional[dict] = None
    # a CPU: the dry run takes the kernels `auto` picks there, not a GPU's (planner/host_kernels.py)
    runs_cpu_kernels: bool = False

    @property
    def usable_bytes(self) -> float:
        """What a training step's tensors may use: HBM less the runtime's own reservations."""
        return self.memory_bytes - self.reserved_bytes

    def peak(self, dtype: torch.dtype) -> float:
        """Dense peak for a matmul whose inputs have `dtype` (fp32 matmuls use TF32 tensor cores, as
        torch.backends.cuda.matmul.allow_tf32 / Megatron do)."""
        return self.peak_flops.get(dtype_key(dtype), self.peak_flops["bf16"])


def dtype_key(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "bf16", torch.float32: "tf32",
            torch.float64: "fp64"}.get(dtype, "fp8" if "float8" in str(dtype) else "bf16")


GB = 1e9


def _peaks(key: str) -> dict:
    return {k: v for k, v in PEAK_FLOPS[key].items() if k != "fp16"}


GPUS: dict[str, GPU] = {
    "a100": GPU("A100-SXM4-80GB", _peaks("a100"), 2.039e12, 80 * 2**30, 300 * GB, 25 * GB,
                pcie_bytes_per_s=32e9, sm_count=108),
    "h100": GPU("H100-SXM5-80GB", _peaks("h100"), 3.35e12, 80 * 2**30, 450 * GB, 50 * GB,
                attention_efficiency=HOPPER_ATTENTION),
    "h200": GPU("H200-SXM-141GB", _peaks("h200"), 4.8e12, 141e9, 450 * GB, 50 * GB,
                attention_efficiency=HOPPER_ATTENTION),
    "b200": GPU("B200-SXM-180GB", _peaks("b200"), 8.0e12, 180e9, 900 * GB, 50 * GB, sm_count=148),
}


def gpu(name: str) -> GPU:
    key = name.lower().replace("-", "").replace("_", "")
    key = {"a10080gb": "a100", "h100sxm": "h100", "h100sxm5": "h100"}.get(key, key)
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; the planner knows {', '.join(GPUS)} and cpu (this machine, "
                         f"measured: launch/plan.py --gpu cpu)")
    return GPUS[key]


def gpu_of_device(device_name: str) -> GPU:
    """The planner's GPU for a device name as `torch.cuda.get_device_name()` reports it ("NVIDIA H200"),
    matched by key substring as parallel3d/hardware.py matches its peaks."""
    name = device_name.lower()
    for key, found in GPUS.items():
        if key in name:
            return found
    raise ValueError(f"no planner GPU for device {device_name!r}; the planner knows {', '.join(GPUS)}")
