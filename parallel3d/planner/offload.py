"""Offload in the plan: the device step is dry-run without it, then the offloaded state moves to the host.

The stand-in device cannot copy to the host (meta tensors hold no values), so a layout with
`parallel.offload_optimizer` / `parallel.offload_params` is dry-run with both off, and then:
  - memory: the optimizer state the dry run measured (fp32 master, m, v of this rank's shard) leaves the
    device for the host (cpu) or the disk (nvme); so do the gradients, bucket by bucket as they are reduced
    (the device keeps the two largest buckets: one accumulating, one on its way; the host holds the
    gradient the rank keeps, an upper bound for ZeRO-1's segment); with `offload_params` the ZeRO-3
    parameter shard leaves too;
  - time (`exposed_offload`), as the code overlaps it (parallel3d/offload/streams.py): each reduced
    gradient bucket goes down over PCIe while the last microbatch's backward goes on, so only what exceeds
    that backward is exposed, and at least the last bucket's copy; AdamW runs on the host's cores (and with
    nvme the state is read and written once per step), exposed; the updated parameters come up bucket by
    bucket in forward order while the next step's first forward runs, again at least one bucket exposed;
    with `offload_params` each ZeRO-3 gather first fetches its shard over PCIe, which the prefetcher
    overlaps with compute (exposed only where it exceeds it).
  - activation offload (`train.activation_offload`) is not removed: the dry run runs it, and on the stand-in
    its hooks drop each saved tensor and allocate it again at unpack (offload/activations.py), so the
    measured device memory is already the offloaded one. Time: each microbatch's saved bytes go down
    beside its forward and come up beside its backward (`exposed_activation_copies`); host memory holds
    them for every microbatch in flight.

Rates, with their basis (per GPU; a DGX-class node shares its host among 8 GPUs):
  PCIe Gen4/Gen5 x16: `GPU.pcie_bytes_per_s` at 80% (pinned-memory copy benchmarks);
  host step: `GPU.host_step_params_per_s`, the rate of the optimizer step the code runs over host state
    (unscale, norm, clipping, AdamW, the 16-bit publish copy) at the one thread a torchrun rank gets
    (planner/hardware.py states the basis; `--gpu cpu` measures it);
  NVMe: 25 GB/s per node (8 drives of ~3.5 GB/s, as in ZeRO-Infinity's DGX-2 setup) shared by 8 GPUs.
"""
from __future__ import annotations

import copy

from parallel3d.data_parallel.build import bucket_elems
from parallel3d.planner.hardware import GPU
from parallel3d.training.config import ExperimentConfig

NVME_BYTES_PER_S = 25e9 / 8
PCIE_EFFICIENCY = 0.8


def without_offload(cfg: ExperimentConfig) -> ExperimentConfig:
    """The layout the stand-in device can run: the same, with the state kept on the device."""
    run = copy.deepcopy(cfg)
    run.parallel.offload_optimizer, run.parallel.offload_params = "none", "none"
    return run


def apply_offload(cfg: ExperimentConfig, memory: dict, model_state: dict, param_shard_bytes: int,
                  gpu: GPU, grads_at_peak: int = 0, grads_in_flight: int = 0) -> tuple[dict, dict]:
    """(device memory after offload, {"host_bytes", "offload_s"}) for one rank, from its dry-run numbers.
    grads_at_peak: how much the dry run's peak drops when gradients are not counted (`StepTracker.peak`
    excluding them); grads_in_flight: the gradient buckets the device still holds under offload."""
    p = cfg.parallel
    memory = dict(memory)
    extra = {"host_bytes": 0, "offload_s": 0.0, "grads_down_s": 0.0, "params_up_s": 0.0, "host_s": 0.0,
             "bucket_copy_s": 0.0, "param_fetch_s": 0.0}
    if p.offload_optimizer != "none":
        state = model_state["optimizer"]             # fp32 master + m + v of the shard: 12 bytes/param
        shard_params = state / 12
        memory["optimizer"] = 0
        memory["peak"] -= state
        # the reduced gradients leave per bucket as they complete and accumulate on the host
        # (offload/host_grads.py): the device keeps the buckets in flight, the host the held gradient
        memory["peak"] += grads_in_flight - grads_at_peak
        memory["grads"] = grads_in_flight
        held = model_state["grads"] + grads_in_flight // 2   # + one staging bucket
        extra["grads_at_peak"], extra["grads_in_flight"], extra["host_grads"] = grads_at_peak, grads_in_flight, held
        extra["host_bytes"] += (state if p.offload_optimizer == "cpu" else 0) + held
        pcie = gpu.pcie_bytes_per_s * PCIE_EFFICIENCY
        extra["grads_down_s"], extra["params_up_s"] = 4 * shard_params / pcie, 2 * shard_params / pcie
        bucket = 4 * bucket_elems(p.dp * p.cp, p.bucket_size, p.bucket_size_mb)   # fp32 gradient bytes
        extra["bucket_copy_s"] = min(bucket / pcie, extra["grads_down_s"])
        extra["host_s"] = shard_params / gpu.host_step_params_per_s
        if p.offload_optimizer == "nvme":
            extra["host_s"] += 2 * state / NVME_BYTES_PER_S   # read and write back master, m, v
        extra["offload_s"] = extra["grads_down_s"] + extra["params_up_s"] + extra["host_s"]  # all serial
    if p.offload_params != "none":
        shard = param_shard_bytes                    # ZeRO-3's persistent parameter shard
        memory["params"] -= shard                    # gathered parameters in use stay on the device
        memory["peak"] -= shard
        extra["host_bytes"] += shard if p.offload_params == "cpu" else 0
        extra["param_fetch_s"] = 2 * shard / (gpu.pcie_bytes_per_s * PCIE_EFFICIENCY)  # forward + backward
    return memory, extra


def exposed_offload(moved: dict, last_backward_s: float, first_forward_s: float, compute_s: float) -> float:
    """Seconds the offload adds to a step (module docstring): copies hidden behind the compute that runs
    beside them, never less than one bucket's copy each way; the host step / NVMe time in full."""
    if not moved["offload_s"] and not moved["param_fetch_s"]:
        return 0.0
    copies = 0.0
    if moved["offload_s"]:
        one = moved["bucket_copy_s"]
        copies = (max(one, moved["grads_down_s"] - last_backward_s) +
                  max(one, moved["params_up_s"] - first_forward_s))
    return copies + moved["host_s"] + max(0.0, moved["param_fetch_s"] - compute_s)


def exposed_activation_copies(bytes_per_microbatch: int, forward_s: float, backward_s: float, gpu: GPU) -> float:
    """Seconds per microbatch the activation copies add: down during the forward, up during the backward,
    each hidden behind its pass's compute."""
    one_way = bytes_per_microbatch / (gpu.pcie_bytes_per_s * PCIE_EFFICIENCY)
    return max(0.0, one_way - forward_s) + max(0.0, one_way - backward_s)
