"""run_training: the outer loop around Trainer (checkpoint load/save, evaluation, metrics)."""
from __future__ import annotations

from parallel3d.mesh import ParallelContext
from parallel3d.training.config import ExperimentConfig
from parallel3d.training.metrics import MetricsLogger, flops_per_token
from parallel3d.training.trainer import BuildStage, Trainer, make_dataset


def load_weights_if_any(trainer: Trainer, load_dir: str | None) -> None:
    """Weights-only checkpoints (e.g. a Hugging Face import) initialise the model; training starts at 0."""
    if not load_dir:
        return
    from parallel3d.checkpoint.store import CheckpointReader, load_model_weights

    reader = CheckpointReader(load_dir)
    for chunk in trainer.chunks:
        load_model_weights(reader, chunk)
    trainer.optimizer.reload_model_weights() if hasattr(trainer.optimizer, "reload_model_weights") else None


def run_training(cfg: ExperimentConfig, ctx: ParallelContext, build_stage: BuildStage) -> list[dict]:
    trainer = Trainer(cfg, ctx, build_stage)
    load_weights_if_any(trainer, cfg.checkpoint.load_dir)
    eval_data = make_dataset(cfg, cfg.data.eval_path, seed_offset=1) if cfg.train.eval_interval else None
    records = []
    is_rank0 = ctx.rank == 0
    logger = MetricsLogger(cfg.log.jsonl, flops_per_token=flops_per_token(cfg.model, cfg.train.seq_len),
                           world_size=ctx.world_size, peak_flops=cfg.log.peak_flops, precision=cfg.train.precision,
                           device=ctx.device, tensorboard_dir=cfg.log.tensorboard, is_rank0=is_rank0,
                           print_interval=cfg.log.interval)
    with logger:
        while trainer.step < cfg.train.steps:
            out = trainer.train_step()
            extra = {"skipped": out["skipped"], "loss_scale": getattr(trainer.optimizer, "loss_scale", 1.0)}
            for chunk in trainer.chunks:
                if hasattr(chunk, "moe_load_stats"):
                    extra.update(chunk.moe_load_stats())
            if eval_data is not None and trainer.step % cfg.train.eval_interval == 0:
                extra["eval_loss"], _ = trainer.evaluate(eval_data, cfg.train.eval_steps)
            records.append(logger.log(out["step"], loss=out["loss"], grad_norm=out["grad_norm"], lr=out["lr"],
                                      tokens=out["tokens"], elapsed_s=out["elapsed_s"], extra=extra))
    return records
