"""The selftest's layouts, as data: each dimension alone and the common combinations, all filling the world.

Every layout uses every rank: its fixed degrees (tp, cp, pp) stay small and parallel.dp takes what the world
leaves (tp2 at world 4 is tp2 x dp2, at world 8 tp2 x dp4), so no rank idles and the data-parallel reduction
is always exercised beside the dimension under test. Overrides may name the world: "{world}" and
"{half_world}" are filled in by `overrides_at` (ep == dp: parallel.ep={world}; HSDP: dp_shard={half_world}).

The global batch is 2 x world sequences of 16 tokens, so every layout has at least 4 microbatches per DP rank
at pp=2 (the V schedules need 2 x pp) and a microbatch count divisible by pp (interleaved). The world-size-1
reference of a layout is the same model and batch on one device with no parallelism at all: the plain run,
with ZeRO-0 and no pipeline, that every layout must reproduce.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional, Sequence

from parallel3d.pipeline.schedules import SCHEDULE_NAMES

# The tiny preset shrunk further: 4 layers (the interleaved and V schedules put 4 stages on pp=2), hidden 32,
# 4 query and 2 KV heads (tp2 keeps one KV head a rank; Ulysses at cp2 splits 4 heads), sequences of 16 tokens.
# fp32 with Adam's eps at 1e-4: a layout's different summation order cannot flip the sign of a tiny
# gradient's update (tests/parity.py), so the weights agree to 1e-4.
BASE = ("model.hidden_size=32", "model.num_layers=4", "model.num_heads=4", "model.num_kv_heads=2",
        "model.ffn_hidden_size=64", "model.tie_embeddings=false", "train.seq_len=16", "train.micro_batch_size=1",
        "train.global_batch_size={double_world}", "train.precision=fp32", "train.lr=3e-3", "train.eps=1e-4",
        "train.warmup_steps=0", "train.lr_schedule=constant", "train.grad_clip=1.0", "train.eval_interval=0",
        "parallel.tp=1", "parallel.zero=0", "checkpoint.save_dir=null", "checkpoint.load_dir=null",
        "log.jsonl=null", "log.timeline=null")
# What each kind of model adds. MoE: no balancing losses, which are computed over each global microbatch and so
# depend on how a layout groups sequences (docs/architecture.md, section 2.2); experts a multiple of the world,
# so that ep == dp divides them. Packed documents: the space byte ends a document, so the synthetic text's
# every word is one and a few straddle the CP chunk boundaries.
MODELS = {
    "dense": (),
    "moe": ("model.num_experts={experts}", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32",
            "model.aux_loss_coef=0", "model.z_loss_coef=0"),
    "documents": ("data.document_masking=true", "data.eos_id=32"),
}


@dataclass(frozen=True)
class Layout:
    name: str
    overrides: tuple[str, ...]     # the layout's degrees and options; parallel.dp fills the world
    model: str = "dense"           # a key of MODELS: which model (and so which world-size-1 reference)
    multiple_of: int = 1           # the world must be a multiple of this (the fixed degrees' product)
    min_world: int = 2             # and at least this (combinations that need dp >= 2 beside two dimensions)
    bandwidth: tuple[str, ...] = ()  # "group:op" bus bandwidths measured on this layout's groups

    def skip_reason(self, world: int) -> Optional[str]:
        """Why this layout cannot run at `world` (None: it can)."""
        if world < self.min_world:
            return f"skipped: needs world >= {self.min_world}"
        if world % self.multiple_of:
            return f"skipped: needs a world divisible by {self.multiple_of}"
        return None


def _schedule(name: str) -> tuple[str, ...]:
    return ("parallel.pp=2", f"parallel.schedule={name}") + (
        ("parallel.virtual_stages=2",) if name == "interleaved" else ())


COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")
# (layouts of one mesh stay together: they share its process groups, built once)
LAYOUTS: tuple[Layout, ...] = (
    Layout("dp", (), bandwidth=tuple(f"dp:{op}" for op in (*COLLECTIVES, "all_to_all"))),
    *(Layout(f"zero{z}", (f"parallel.zero={z}",)) for z in (1, 2, 3)),
    # the paths with side streams and gathers in flight across steps (issue 48's NCCL defects)
    Layout("zero1-overlap-gather", ("parallel.zero=1", "parallel.overlap_param_gather=true")),
    Layout("zero3-offload-cpu", ("parallel.zero=3", "parallel.offload_optimizer=cpu", "parallel.offload_params=cpu")),
    Layout("hsdp-zero3", ("parallel.zero=3", "parallel.dp_shard={half_world}"), multiple_of=2, min_world=4),
    Layout("tp2", ("parallel.tp=2",), multiple_of=2, bandwidth=tuple(f"tp:{op}" for op in COLLECTIVES)),
    Layout("tp2-sp", ("parallel.tp=2", "parallel.sp=true"), multiple_of=2),
    *(Layout(f"pp2-{s}", _schedule(s), multiple_of=2, bandwidth=("pp:p2p",) if s == "1f1b" else ())
      for s in SCHEDULE_NAMES),
    *(Layout(f"cp2-{mode}", ("parallel.cp=2", f"parallel.cp_mode={mode}"), multiple_of=2,
             bandwidth=("cp:all_gather",) if mode == "allgather" else ())
      for mode in ("ring", "allgather", "ulysses")),
    Layout("documents-cp2", ("parallel.cp=2",), model="documents", multiple_of=2),
    Layout("ep-eq-dp", ("parallel.ep={world}", "parallel.zero=1"), model="moe", bandwidth=("ep:all_to_all",)),
    # each backward paired with the next forward, the all-to-alls in turns (parallel.ep_overlap), and the experts'
    # weight gradients beside the input gradient's all-to-all (model.moe_delay_wgrad)
    Layout("ep-eq-dp-overlap", ("parallel.ep={world}", "parallel.zero=1", "parallel.ep_overlap=true",
                                "model.moe_delay_wgrad=true"), model="moe"),
    Layout("ep-eq-dp-tp2-sp", ("parallel.tp=2", "parallel.sp=true", "parallel.ep={half_world}"), model="moe",
           multiple_of=2, min_world=4),
    Layout("documents-cp2-tp2-sp", ("parallel.cp=2", "parallel.tp=2", "parallel.sp=true"), model="documents",
           multiple_of=4),
    Layout("tp2-sp-pp2-zero1", ("parallel.tp=2", "parallel.sp=true", "parallel.pp=2", "parallel.zero=1"),
           multiple_of=4, min_world=8),
    Layout("tp2-cp2-pp2-interleaved", ("parallel.tp=2", "parallel.cp=2", *_schedule("interleaved")),
           multiple_of=8, min_world=8),
)
NAMES = tuple(layout.name for layout in LAYOUTS)


def select(patterns: Optional[Sequence[str]]) -> tuple[Layout, ...]:
    """The layouts `--only` names (exact names or shell patterns: "pp2-*"), in table order; all for None.
    Raises ValueError naming any pattern that matches nothing."""
    if not patterns:
        return LAYOUTS
    unmatched = [p for p in patterns if not fnmatch.filter(NAMES, p)]
    if unmatched:
        raise ValueError(f"--only: no layout named {', '.join(unmatched)}; the layouts are {', '.join(NAMES)}")
    return tuple(layout for layout in LAYOUTS if any(fnmatch.fnmatch(layout.name, p) for p in patterns))


def _filled(overrides: Sequence[str], world: int) -> list[str]:
    values = {"world": world, "half_world": max(world // 2, 1), "double_world": 2 * world,
              "experts": world * max(1, 8 // world)}
    return [o.format(**values) for o in overrides]


def overrides_at(layout: Layout, world: int) -> list[str]:
    """The whole override list of `layout` at `world` ranks (BASE, the model's, the layout's)."""
    return _filled([*BASE, *MODELS[layout.model], *layout.overrides], world)


def reference_overrides(layout: Layout, world: int) -> list[str]:
    """The override list of its world-size-1 run: the same model and global batch, no parallelism."""
    return _filled([*BASE, *MODELS[layout.model]], world)


def mesh_words(parallel) -> str:
    """A resolved ParallelConfig as "tp2 cp2 dp2 pp2 ep4" (degrees above 1; dp always)."""
    words = [f"{d}{getattr(parallel, d)}" for d in ("tp", "cp", "dp", "pp", "ep")
             if getattr(parallel, d) > 1 or d == "dp"]
    if parallel.dp_shard and parallel.dp_shard != parallel.dp:
        words.append(f"shard{parallel.dp_shard}")
    if parallel.zero:
        words.append(f"zero{parallel.zero}")
    return " ".join(words)
