"""Pretraining entry point.

    torchrun --nproc_per_node=N launch/pretrain.py --config configs/tiny.yaml [key=value ...]

Every parallel dimension comes from the config (parallel.tp/pp/dp/cp/ep/sp/zero/schedule/...); see
docs/configuration.md. Bad input ends with one message on stderr and exit code 2, before any process group.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (RUN_ERRORS, USER_ERRORS, build_context, exit_cleanly_on_sigterm, fail,  # noqa: E402
                    load_and_validate, parse_args, shutdown, stage_builder)


def main(argv=None) -> int:
    args, overrides = parse_args("parallel3d pretraining", argv)
    try:
        cfg = load_and_validate(args.config, overrides)
    except USER_ERRORS as e:
        fail(str(e))
    from parallel3d.training.loop import run_training

    exit_cleanly_on_sigterm(cfg)
    ctx = build_context(cfg)
    try:
        run_training(cfg, ctx, stage_builder(cfg, ctx))
    except RUN_ERRORS as e:
        fail(f"[rank {ctx.rank}] {e}", every_rank=True)  # no teardown: peers may be stuck; torchrun ends them
    del ctx  # nothing may hold a process group past shutdown()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
