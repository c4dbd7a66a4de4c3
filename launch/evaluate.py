"""Evaluate a checkpoint on a token file under any layout.

    torchrun --nproc_per_node=N launch/evaluate.py --config C [key=value ...] checkpoint.load_dir=D data.path=T
    ... data.paths=held_a.npy:0.7,held_b.npy:0.3        (held-out file of each mixture source)

Prints, as its last stdout line, {"loss": <mean token loss>, "tokens": <count>}. With data.paths every
source is evaluated on its own (weights are ignored: each file is read in order, whole batches), a line
per source is printed first, and the last line adds "sources": {path: {"loss", "tokens"}}; its "loss"
is then the token-weighted mean over the sources. data.document_masking / data.eos_id apply as in
training (the loss of every document alone).
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
        if cfg.data.path is None and cfg.data.paths is None:
            raise ValueError("evaluate.py needs data.path=TOKENS.npy (or data.paths=A.npy:W,B.npy:W)")
    except USER_ERRORS as e:
        fail(str(e))
    from parallel3d.training.loop import load_weights_if_any
    from parallel3d.training.trainer import Trainer

    ctx = build_context(cfg)
    try:
        trainer = Trainer(cfg, ctx, stage_builder(cfg, ctx), train=False)
        load_weights_if_any(trainer, cfg.checkpoint.load_dir)
        if cfg.data.paths is None:
            sources = {cfg.data.path: trainer.dataset}
        else:
            sources = {d.path: d for d in trainer.dataset.sources}
        results = {}
        for name, dataset in sources.items():
            steps = max(1, len(dataset) // cfg.train.global_batch_size)
            results[name] = trainer.evaluate(dataset, steps)
    except RUN_ERRORS as e:
        fail(f"[rank {ctx.rank}] {e}", every_rank=True)  # no teardown: peers may be stuck; torchrun ends them
    rank = ctx.rank
    del ctx, trainer  # nothing may hold a process group past shutdown()
    shutdown()
    if rank == 0:
        tokens = sum(t for _, t in results.values())
        loss = sum(l * t for l, t in results.values()) / max(tokens, 1.0)
        line = {"loss": loss, "tokens": int(tokens)}
        if cfg.data.paths is not None:
            for name, (l, t) in results.items():
                print(f"source {name}: loss {l:.6f} over {int(t)} tokens", flush=True)
            line["sources"] = {name: {"loss": l, "tokens": int(t)} for name, (l, t) in results.items()}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
