"""What the dry run runs when it stands for a CPU (`launch/plan.py --gpu cpu`, benchmarks/planner_accuracy.py).

The meta device normally stands for CUDA: `auto` kernels take our Triton kernels' custom ops, attention
our flash kernel, routed experts grouped_mm. A CPU run takes none of them: `auto` resolves to the torch
twins (kernels.dispatch.use_triton), aten's CPU flash attention in causal bands
(kernels.attention_backend.select_attention) and the expert loop (expert_parallel.experts.choose_impl).
Those run several times as many ops, and on a CPU each op costs the host's per-op overhead, so planning a
CPU run with the GPU's kernels priced a third of its ops (the 1.9-3.1x gap of RESULTS.md's CPU table).
`as_run_on_cpu` gives the dry run the CPU's choices; the FLOP formulas below price aten's CPU flash ops,
which torch's flop counter does not know, the way kernels/ops.py counts our kernel (causal: the visible
pairs only), so the profile's attention curves (profile.py) apply to them.
"""
from __future__ import annotations

import copy

import torch

from parallel3d.training.config import ExperimentConfig

CPU_FLASH_FWD = "_scaled_dot_product_flash_attention_for_cpu"
CPU_FLASH_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"
# the op -> the profile's curve that timed it (profile._attention_curves times these very ops)
CURVE_OF_OP = {CPU_FLASH_FWD: "flash_attention_fwd", CPU_FLASH_BWD: "flash_attention_bwd"}


def as_run_on_cpu(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with every `auto` kernel choice resolved as a CPU resolves it: each owner of a choice is asked
    about a CPU tensor of the run's compute dtype (module docstring)."""
    from parallel3d.data_parallel.adamw import block_for
    from parallel3d.data_parallel.precision import compute_dtype
    from parallel3d.expert_parallel.experts import choose_impl
    from parallel3d.kernels.attention_backend import select_attention
    from parallel3d.kernels.dispatch import use_triton

    run = copy.deepcopy(cfg)
    m = run.model
    probe = torch.empty(1, 1, 1, 8, dtype=compute_dtype(run.train.precision))   # (b, s, heads, d) on the CPU
    if m.kernels == "auto":
        m.kernels = "triton" if use_triton("auto", probe) else "torch"
    if m.attention == "auto":
        m.attention = select_attention("auto", probe, need_lse=False)
    if run.train.adamw_block == 0:   # the CPU's cache-sized blocks: about 7 ops each, at the host's per-op cost
        run.train.adamw_block = block_for(probe.device)
    if m.expert_impl == "auto":
        m.expert_impl = choose_impl("auto", probe.view(1, 8), m.hidden_size, m.moe_ffn_hidden_size or m.ffn_hidden_size)
    return run


def _pairs(sq: int, sk: int, causal: bool) -> float:
    """(query, key) pairs computed per (batch, head): aten's CPU flash op aligns a causal mask top-left."""
    if not causal:
        return float(sq * sk)
    if sq <= sk:
        return sq * (sq + 1) / 2
    return sk * (sk + 1) / 2 + (sq - sk) * sk


def _fwd_flops(query, key, value, dropout_p=0.0, is_causal=False, *args, **kwargs) -> float:
    b, h, sq, d = query.shape   # (b, hq, sq, d)
    return 4.0 * b * h * _pairs(sq, key.shape[2], bool(is_causal)) * d


def _bwd_flops(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *args,
               **kwargs) -> float:
    b, h, sq, d = query.shape   # five matmuls: 2.5 times the forward
    return 10.0 * b * h * _pairs(sq, key.shape[2], bool(is_causal)) * d


FLOPS = {CPU_FLASH_FWD: _fwd_flops, CPU_FLASH_BWD: _bwd_flops}
