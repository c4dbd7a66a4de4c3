"""Execute a pipeline schedule on this rank: a plain dispatch over its plan.

The schedule (``schedules.py``) decides *what* runs *when*; this module only does each action.
``run_pipeline_step`` builds and verifies the schedule once (``ScheduleCache``), turns this rank's
list once into a plan (``runtime_schedules.rank_plan``: compute actions, and each maximal run of
communication actions posted as ONE ``batch_isend_irecv`` group), then walks it. Sends finish in
the background; receives are waited by the compute that reads them, and where the backend allows
(gloo) they are posted one group early, so they travel while the compute before them runs
(``p2p.py``, ``mailbox.py``); there DualPipe-V's sends are also posted right after the compute that
made them, so a pair's F output travels while its partner B computes (``posting.py``).

Tensors between stages are the residual stream ``(micro_batch, s_local, h)``: ``s_local = s / cp``
(the microbatch's ``ids`` are already this rank's CP shard) and ``/ tp`` more when the chunk runs
Megatron sequence parallelism (``chunk.sp``), in the dtype of the chunk's parameters. A chunk
is any module with ``forward(x, position_ids, labels=None)``, a ``cfg.hidden_size`` and
optionally ``sp``; on the last stage it returns the summed token loss.

The executor that does each action, and what a slot keeps, is ``executor.py``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

from parallel3d.mesh import ParallelContext

from .executor import Executor, PipelineStats, Record  # noqa: F401  (PipelineStats, Record: the runtime's API)
from .placement import placement_for, placement_of, stage_of
from .runtime_schedules import ScheduleCache, forward_only_schedule, rank_plan  # noqa: F401


def _check_chunks(ctx: ParallelContext, chunks: Sequence[nn.Module], mbs: Sequence[dict],
                  placement: str) -> None:
    if not chunks:
        raise ValueError("a pipeline run needs at least one model chunk")
    if not mbs:
        raise ValueError("a pipeline run needs at least one microbatch")
    p, last = ctx.spec.pp, ctx.spec.pp * len(chunks) - 1
    for c, chunk in enumerate(chunks):  # catch a mis-built stage before the pipeline hangs
        s = stage_of(ctx.coords.pp, c, p, placement)
        for flag, want in (("pre", s == 0), ("post", s == last)):
            if getattr(chunk, flag) != want:
                raise ValueError(f"chunk {c} on pipeline rank {ctx.coords.pp} is global stage {s} "
                                 f"of {last + 1}: expected {flag}={want}")


def run_pipeline_step(ctx: ParallelContext, chunks: Sequence[nn.Module], schedule: str,
                      mbs: Sequence[dict], *, loss_scale: float,
                      backward: Callable[[torch.Tensor], None],
                      before_backward: Callable[[int, int], None] | None = None,
                      record: Record | None = None, stats: PipelineStats | None = None,
                      schedules: ScheduleCache | None = None, lazy_sends: bool = True,
                      ep_overlap: bool = False) -> torch.Tensor:
    """Forward and backward of ``len(mbs)`` microbatches through this rank's ``chunks``.

    The last stage calls ``backward(loss_sum * loss_scale)`` per microbatch (for split backwards,
    on a detached copy: ``backward`` must be linear, e.g. loss scaling); other stages backpropagate
    the received gradient. ``before_backward(mb, chunk)`` runs before every backward action (B, I,
    W). Returns the sum of ``loss_sum * loss_scale`` (fp32, detached) on the last stage, 0 elsewhere.
    ``record`` gets ``(pp rank, action, start, end)`` per action (``Timeline.from_events``),
    ``stats`` the peak of live activations. ``schedules`` caches verified schedules across steps;
    ``lazy_sends=False`` waits for every send where it is posted (the verifier's strict model).
    ``ep_overlap``: backward/forward pairs of different microbatches run in turns, so each one's expert
    all-to-alls travel while the other computes (``pairing.py``, ``interleave.py``).
    """
    _check_chunks(ctx, chunks, mbs, placement_of(schedule))
    cache = schedules or ScheduleCache()
    placement = placement_for(cache.get(schedule, ctx.spec.pp, len(mbs), len(chunks)))
    run = Executor(ctx, chunks, mbs, loss_scale, backward, before_backward, record,
                   stats if stats is not None else PipelineStats(), lazy_sends=lazy_sends,
                   placement=placement)
    return run.run(cache.plan(schedule, ctx.spec.pp, len(mbs), len(chunks), ctx.coords.pp, run.mail.queue.early,
                              ep_overlap))


@torch.no_grad()
def run_pipeline_forward(ctx: ParallelContext, chunks: Sequence[nn.Module], mbs: Sequence[dict],
                         *, record: Record | None = None, placement: str = "loop") -> torch.Tensor:
    """Evaluation: sum over microbatches of the loss_sum on the last stage, 0 elsewhere.
    ``placement``: which rank holds which stage (``placement.placement_of(schedule)``)."""
    _check_chunks(ctx, chunks, mbs, placement)
    lists = forward_only_schedule(ctx.spec.pp, len(mbs), len(chunks), placement)
    run = Executor(ctx, chunks, mbs, record=record, train=False, placement=placement)
    return run.run(rank_plan(lists[ctx.coords.pp], run.mail.queue.early))
