"""run_training: the outer loop around Trainer (checkpoint resume/save, evaluation, metrics).

Checkpoint policy (parallel3d.checkpoint.CheckpointManager): start from checkpoint.load_dir, or, when
torchrun restarted the job (TORCHELASTIC_RESTART_COUNT > 0, e.g. `--max-restarts=1` after a rank died),
from the newest complete checkpoint in checkpoint.save_dir; save every checkpoint.interval steps and at the
end. Resuming replays the exact data, LR and optimizer state, so the losses continue as if never stopped.
"""
from __future__ import annotations

import time

from parallel3d.mesh import ParallelContext
from parallel3d.training.config import ExperimentConfig
from parallel3d.training.metrics import MetricsLogger, flops_per_token
from parallel3d.training.trainer import BuildStage, Trainer, make_dataset


def load_weights_if_any(trainer: Trainer, load_dir: str | None) -> None:
    """Model weights only (evaluation): from a weights-only import or a full training checkpoint, a step
    directory or a save root (follows `latest`). The step and optimizer stay fresh."""
    if not load_dir:
        return
    from parallel3d.checkpoint import load_checkpoint

    load_checkpoint(trainer, load_dir, model_only=True)


def write_run_timeline(trainer: Trainer, recorded: list[tuple[int, list]]) -> None:
    """log.timeline: the last recorded step beside its schedule simulated with the measured costs; the JSON
    also keeps every recorded step's measured timeline. `recorded`: (step as logged, gathered rows)."""
    from parallel3d.pipeline.timeline import from_rows, measured_and_simulated, to_rows, write_timeline

    cfg, p = trainer.cfg, trainer.cfg.parallel
    v = len(trainer.chunks)
    schedule = trainer.schedules.get(p.schedule, p.pp, cfg.train.num_microbatches, v)
    steps = []
    for step, rows in recorded:
        measured, simulated = measured_and_simulated(from_rows(rows), schedule)
        steps.append({"step": step, "measured_bubble": float(measured.bubble_fraction),
                      "measured": to_rows(measured.records())})
    path = write_timeline(cfg.log.timeline, measured, simulated, title=f" ({p.schedule}, pp={p.pp})",
                          step=step, steps=steps if len(steps) > 1 else None)
    if trainer.ctx.is_simulated:   # one rank's actions: the other stages' rows are empty, so no bubble to read
        print(f"timeline of step {step} ({p.schedule}, pp={p.pp}): simulated rank {trainer.ctx.rank}'s own actions "
              f"(pipeline stage {trainer.ctx.coords.pp}) -> {path}", flush=True)
        return
    print(f"timeline of step {step} ({p.schedule}, pp={p.pp}): measured bubble "
          f"{float(measured.bubble_fraction):.1%}, simulated with the measured costs "
          f"{float(simulated.bubble_fraction):.1%} -> {path}"
          + (f"; the JSON keeps steps {steps[0]['step']}-{step}" if len(steps) > 1 else ""), flush=True)


def simulated_fields(ctx: ParallelContext) -> dict:
    """The JSONL's `simulated` field of a simulated rank's rows: which rank of which world they measured
    (planner/compare.py reads it to set the rank's own stage beside the plan)."""
    return {"rank": ctx.rank, "world_size": ctx.world_size, "pp_rank": ctx.coords.pp,
            "device": str(ctx.device)}


def run_training(cfg: ExperimentConfig, ctx: ParallelContext, build_stage: BuildStage) -> list[dict]:
    from parallel3d.checkpoint import CheckpointManager

    started = time.perf_counter()  # the summary's wall time covers building, training, evaluation, saving
    trainer = Trainer(cfg, ctx, build_stage)
    checkpoints = CheckpointManager(trainer)
    checkpoints.resume()
    eval_data = make_dataset(cfg, cfg.data.eval_path, seed_offset=1) if cfg.train.eval_interval else None
    records, timelines = [], []   # timelines: the recorded steps' (step, rows), written after the last
    is_rank0 = ctx.rank == 0 or ctx.is_simulated   # a simulated rank (pretrain.py --simulate-rank) reports alone
    simulated = simulated_fields(ctx) if ctx.is_simulated else None
    logger = MetricsLogger(cfg.log.jsonl, flops_per_token=flops_per_token(cfg.model, cfg.train.seq_len),
                           world_size=ctx.world_size, peak_flops=cfg.log.peak_flops, precision=cfg.train.precision,
                           device=ctx.device, tensorboard_dir=cfg.log.tensorboard, is_rank0=is_rank0,
                           print_interval=cfg.log.interval)
    with logger:
        while trainer.step < cfg.train.steps:
            out = trainer.train_step()
            extra = {"skipped": out["skipped"], "loss_scale": out["loss_scale"], "comm_bytes": out["comm_bytes"]}
            for chunk in trainer.chunks:
                if hasattr(chunk, "moe_load_stats"):
                    extra.update(chunk.moe_load_stats())
            # the step's host syncs by category (parallel3d.host_sync) with the MoE telemetry read above
            extra["host_syncs"] = ctx.stats.syncs.summary()
            if simulated is not None:
                extra["simulated"] = simulated
            if eval_data is not None and trainer.step % cfg.train.eval_interval == 0:
                extra["eval_loss"], _ = trainer.evaluate(eval_data, cfg.train.eval_steps)
            records.append(logger.log(out["step"], loss=out["loss"], grad_norm=out["grad_norm"], lr=out["lr"],
                                      tokens=out["tokens"], elapsed_s=out["elapsed_s"], extra=extra))
            if out["timeline"] is not None and is_rank0:
                timelines.append((out["step"], out["timeline"]))
                if trainer.step - 1 == trainer.timeline_window()[-1]:
                    write_run_timeline(trainer, timelines)
            checkpoints.after_step()
        checkpoints.finish()
        logger.print_summary(started)
    return records
