"""Evaluate a checkpoint on a token file under any layout.

    torchrun --nproc_per_node=N launch/evaluate.py --config C [key=value ...] checkpoint.load_dir=D data.path=T

Prints, as its last stdout line, {"loss": <mean token loss>, "tokens": <count>}.
"""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (RUN_ERRORS, USER_ERRORS, build_context, fail, load_and_validate, parse_args,  # noqa: E402
                    shutdown, stage_builder)


def main(argv=None) -> int:
    args, overrides = parse_args("parallel3d evaluation", argv)
    try:
        cfg = load_and_validate(args.config, overrides)
        if cfg.checkpoint.load_dir is None:
            raise ValueError("evaluate.py needs checkpoint.load_dir=DIR")
        if cfg.data.path is None:
            raise ValueError("evaluate.py needs data.path=TOKENS.npy")
    except USER_ERRORS as e:
        fail(str(e))
    from parallel3d.training.loop import load_weights_if_any
    from parallel3d.training.trainer import Trainer

    ctx = build_context(cfg)
    try:
        trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx), train=False)
        load_weights_if_any(trainer, cfg.checkpoint.load_dir)
        steps = max(1, len(trainer.dataset) // cfg.train.global_batch_size)
        loss, tokens = trainer.evaluate(trainer.dataset, steps)
    except RUN_ERRORS as e:
        fail(f"[rank {ctx.rank}] {e}")  # no teardown: peers may be stuck; torchrun ends them
    rank = ctx.rank
    del ctx, trainer  # nothing may hold a process group past shutdown()
    shutdown()
    if rank == 0:
        print(json.dumps({"loss": loss, "tokens": int(tokens)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
