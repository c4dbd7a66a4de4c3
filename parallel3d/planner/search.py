"""Layout search: every valid layout for a world size, dry-run in a promising order, best first.

Enumeration (pure arithmetic; validation is the config's own, `resolve_and_validate`): tp over divisors of
the world up to one node and dividing the heads; cp in 1, 2, 4, 8; pp dividing what is left (at most one
stage per layer); for a MoE, every (ep, etp) the mesh folds over a stage's tp * cp * dp ranks
(mesh_spec.expert_folds) that splits the experts (experts.check_expert_split), etp at most tp; zero 0-3; schedules 1f1b,
interleaved with 2 chunks, zb-h1, zb-v and dualpipe-v when pp > 1 (gpipe is dominated by 1f1b: same
bubble, more memory);
micro-batch sizes 1, 2, 4 dividing the per-rank batch; activation checkpointing none, selective, full, and
with none/selective the first N layers of each chunk recomputed whole (train.recompute_layers: 0 and a quarter,
half and three quarters of the chunk's layers).

Each candidate is dry-run in full (estimate.plan), which takes seconds to a minute for large presets, so
candidates are ordered by a prior first: the formulas of docs/parallelism.md and docs/memory.md for model-state and activation
bytes (only to order; the dry run decides), then a textbook step time: ideal compute (with the
recomputation pass), tensor-parallel collectives on their link, half of the data-parallel traffic, and the
schedule's bubble. With `max_candidates` N (launch/plan.py's default 8) the dry runs stop once N layouts
fit, and never exceed 2N (`dry_run_budget`), so a search answers in minutes whatever the world size; 0
dry-runs every valid layout. Each dry run prints a progress line (count, elapsed, estimated time left).
"""
from __future__ import annotations

import dataclasses
import math
import time
import warnings
from typing import Optional, TextIO

from parallel3d.expert_parallel.experts import check_expert_split
from parallel3d.mesh_spec import expert_folds
from parallel3d.pipeline.placement import chunks_per_rank
from parallel3d.planner.dryrun import StageBuilder
from parallel3d.planner.estimate import Plan, plan
from parallel3d.planner.hardware import GPU
from parallel3d.training.config import ConfigError, ExperimentConfig
from parallel3d.training.metrics import flops_per_token, param_counts, total_params
from parallel3d.training.validate import ConfigWarning, resolve_and_validate

DEFAULT_MAX_CANDIDATES = 8   # launch/plan.py --search: dry runs stop once this many layouts fit
SCHEDULES = (("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("dualpipe-v", 2))
RECOMPUTE = ("none", "selective", "full")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: ExperimentConfig, world: int, gpus_per_node: int,
               refusals: Optional[list] = None) -> list[ExperimentConfig]:
    """Every layout of `world` ranks that passes validation (resolved configs). `refusals`, if given,
    collects validation's message per refused layout (what to tell the user when none is valid)."""
    m, out = cfg.model, []
    experts = m.num_experts
    for tp in [d for d in _divisors(world) if d <= gpus_per_node]:
        for cp in [c for c in (1, 2, 4, 8) if (world // tp) % c == 0]:
            for pp in [d for d in _divisors(world // (tp * cp)) if d <= m.num_layers]:
                dp = world // (tp * cp * pp)
                for ep, etp in expert_layouts(cfg, tp, cp, dp):
                    for zero in (0, 1, 2, 3):
                        for schedule, v in SCHEDULES if pp > 1 else SCHEDULES[:1]:
                            for mbs in (1, 2, 4):
                                for ac in RECOMPUTE:
                                    for n in recompute_layer_options(math.ceil(m.num_layers / (pp * v)), ac):
                                        c = _candidate(cfg, world, tp, cp, pp, dp, (ep, etp), zero, schedule, v,
                                                       mbs, ac, refusals, n)
                                        if c is not None:
                                            out.append(c)
    return out


def expert_layouts(cfg: ExperimentConfig, tp: int, cp: int, dp: int) -> list[tuple[int, int]]:
    """(ep, etp) pairs to try on a stage of tp*cp*dp ranks: the mesh's folds whose split of the experts the
    experts accept, with etp at most tp (so inside a node, and the enumeration about 2x its size before
    etp was searched, not 4x; wider splits stay valid to plan by hand); (1, 1) for a dense model."""
    m = cfg.model
    if not m.num_experts:
        return [(1, 1)]
    out = []
    for ep, etp in expert_folds(tp, cp, dp):
        try:
            check_expert_split(m.num_experts, m.moe_ffn_hidden_size or m.ffn_hidden_size, ep, etp)
        except ValueError:
            continue
        if etp <= tp:
            out.append((ep, etp))
    return out


def recompute_layer_options(chunk_layers: int, ac: str) -> list[int]:
    """train.recompute_layers to try for chunks of `chunk_layers` layers: 0, then a quarter, half and three
    quarters of the chunk (all of it is activation_checkpointing=full, tried on its own)."""
    if ac == "full":
        return [0]
    if chunk_layers < 2:
        return [0]
    return sorted({0} | {max(1, chunk_layers * q // 4) for q in (1, 2, 3)} - {chunk_layers})


def _candidate(cfg, world, tp, cp, pp, dp, fold, zero, schedule, v, mbs, ac, refusals=None, recompute_layers=0
               ) -> Optional[ExperimentConfig]:
    # resolve_and_validate copies `c` deeply: these shallow copies only keep `cfg` itself untouched (a
    # search validates tens of thousands of layouts, and two deep copies each were most of its time)
    c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel), train=dataclasses.replace(cfg.train))
    p, t = c.parallel, c.train
    p.tp, p.cp, p.pp, p.dp, p.zero, p.schedule, p.virtual_stages = tp, cp, pp, dp, zero, schedule, v
    p.ep, p.etp = fold
    p.sp, p.layers_per_stage = tp > 1, None
    t.micro_batch_size, t.activation_checkpointing, t.num_microbatches = mbs, ac, 0
    t.recompute_layers = recompute_layers
    try:
        with warnings.catch_warnings():   # a search weighs layouts validation would warn about, by their plans
            warnings.simplefilter("ignore", ConfigWarning)
            return resolve_and_validate(c, world)
    except (ConfigError, ValueError) as e:
        if refusals is not None:
            refusals.append(str(e))
        return None


def prior(cfg: ExperimentConfig, gpu: GPU, gpus_per_node: int) -> tuple[bool, float]:
    """(predicted to fit, predicted step seconds), from the textbook formulas; only orders the dry runs."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    counts = param_counts(m)
    n_dense = total_params(m) - counts["experts_total"]
    per_rank = (n_dense / p.tp + counts["experts_total"] / (p.etp * p.ep)) / p.pp
    shard = {0: 1, 1: 1, 2: 1, 3: p.dp * p.cp}[p.zero]
    state = per_rank * ({0: 16, 1: 4 + 12 / (p.dp * p.cp), 2: 2 + 14 / (p.dp * p.cp)}.get(p.zero, 16 / shard))
    s, b, h, a = t.seq_len // p.cp, t.micro_batch_size, m.hidden_size, m.num_heads
    per_layer = {"none": s * b * h * (34 + 5 * a * s / h) / p.tp, "selective": s * b * h * 34 / p.tp,
                 "full": 2 * s * b * h}[t.activation_checkpointing]
    in_flight = min(p.pp, t.num_microbatches) if p.schedule != "gpipe" else t.num_microbatches
    layers, chunks = math.ceil(m.num_layers / p.pp), chunks_per_rank(p.schedule, p.virtual_stages)
    whole = min(t.recompute_layers * chunks, layers)  # train.recompute_layers: only their input is kept
    acts = (per_layer * (layers - whole) + 2 * s * b * h * whole) * in_flight
    fits = state + acts <= 0.85 * gpu.usable_bytes
    world = p.tp * p.cp * p.pp * p.dp
    ideal = flops_per_token(m, t.seq_len) * t.global_batch_size * t.seq_len / (
        world * gpu.peak_flops["bf16"] * gpu.matmul_efficiency)
    bubble = (p.pp - 1) / (t.num_microbatches + p.pp - 1) / (p.virtual_stages if p.schedule == "interleaved" else 1)
    if p.schedule in ("zb-h1", "zb-v", "dualpipe-v"):
        bubble /= 3 if p.schedule == "zb-h1" else 6  # docs/parallelism.md: ZB-H1 about a third; ZB-V (p-1)/(6m+p-1)
    recompute = 4 / 3 if t.activation_checkpointing == "full" else 1 + whole / layers / 3
    # TP: 8 collectives of the (b, s, h) bf16 activations per layer and microbatch (Megatron block, fwd + bwd);
    # with SP 10: backward gathers each region's saved input shard again (tensor_parallel/region.py)
    tp_link = gpu.nvlink_bytes_per_s if p.tp <= gpus_per_node else gpu.network_bytes_per_s
    tp_comm = ((10 if p.sp else 8) * (p.tp - 1) / p.tp * b * s * h * 2 / tp_link * math.ceil(m.num_layers / p.pp)
               * t.num_microbatches) if p.tp > 1 else 0.0
    # DP: reduce-scatter + all-gather of the rank's fp32 gradients / bf16 parameters, half hidden by backward;
    # ZeRO-3 gathers parameters again for backward (1.5x, docs/parallelism.md)
    dp_link = gpu.network_bytes_per_s if world > gpus_per_node else gpu.nvlink_bytes_per_s
    dp_comm = 0.5 * per_rank * (4 + 2) / dp_link * (1.5 if p.zero == 3 else 1.0) if p.dp * p.cp > 1 else 0.0
    cp_comm = 0.05 * (p.cp - 1) * ideal
    return fits, (ideal * recompute + tp_comm + cp_comm + _expert_comm(cfg, gpu, gpus_per_node)) / (1 - bubble) + dp_comm


def _expert_comm(cfg: ExperimentConfig, gpu: GPU, gpus_per_node: int) -> float:
    """Textbook seconds of a step's expert exchanges (only to order): per MoE layer and microbatch, 4
    all-to-alls (dispatch and combine, forward and backward) of the rank's k routed rows per token, on
    NVLink when the EP group's ep*etp consecutive ranks fit in a node; with etp > 1, 5 collectives of the
    etp group's rows over NVLink (docs/parallelism.md, "Communication")."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if not m.num_experts or p.ep * p.etp == 1:
        return 0.0
    rows = t.micro_batch_size * t.seq_len / (p.cp * p.tp) * m.moe_top_k * m.hidden_size * 2   # bf16 bytes
    link = gpu.nvlink_bytes_per_s if p.ep * p.etp <= gpus_per_node else gpu.network_bytes_per_s
    per_layer = 4 * (p.ep - 1) / p.ep * rows / link + 5 * (p.etp - 1) * rows / gpu.nvlink_bytes_per_s
    return per_layer * math.ceil(m.num_layers / p.pp) * t.num_microbatches


def dry_run_budget(max_candidates: int, valid: int) -> int:
    """How many layouts a search dry-runs at most: 2 per layout asked for (the prior's fit test is rough),
    every valid one when max_candidates is 0."""
    return min(valid, 2 * max_candidates) if max_candidates else valid


def search(cfg: ExperimentConfig, world: int, stage_builder: StageBuilder, gpu: GPU, gpus_per_node: int,
           max_candidates: int = 0, progress: Optional[TextIO] = None) -> list[Plan]:
    """Plans of the layouts that fit, fastest first. Raises ValueError when no layout is valid."""
    refusals: list[str] = []
    found = candidates(cfg, world, gpus_per_node, refusals)
    if not found:
        common = max(set(refusals), key=refusals.count) if refusals else "nothing to enumerate"
        raise ValueError(f"no valid layout for world size {world}: every candidate was refused; the most "
                         f"common reason: {common}")
    ranked = sorted(found, key=lambda c: (lambda f, s: (not f, s))(*prior(c, gpu, gpus_per_node)))
    budget = dry_run_budget(max_candidates, len(ranked))
    if progress is not None:
        print(f"{len(found)} valid layouts; dry-running them in the prior's order until "
              f"{max_candidates or len(ranked)} fit (at most {budget} dry runs)", file=progress, flush=True)
    plans = []
    t0 = time.perf_counter()
    for i, c in enumerate(ranked[:budget]):
        result = plan(c, stage_builder, gpu, gpus_per_node)
        if progress is not None:
            spent = time.perf_counter() - t0
            left = spent / (i + 1) * (budget - i - 1)
            lay = result.layout
            short = " ".join(f"{k}={lay[k]}" for k in ("tp", "pp", "cp", "ep", "etp", "dp", "zero", "schedule",
                                                       "micro_batch_size", "activation_checkpointing"))
            print(f"[{i + 1}/{budget} dry runs, {spent:.0f} s, at most {left:.0f} s left] {short}: "
                  f"fits={result.fits} peak={result.memory['peak'] / 2**30:.1f} GiB "
                  f"tokens/s={result.tokens_per_s:,.0f}", file=progress, flush=True)
        if result.fits:
            plans.append(result)
            if max_candidates and len(plans) >= max_candidates:
                break
    return sorted(plans, key=lambda r: -r.tokens_per_s)
