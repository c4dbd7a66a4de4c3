"""Pretraining entry point.

    torchrun --nproc_per_node=N launch/pretrain.py --config configs/tiny.yaml [key=value ...]
    python launch/pretrain.py --config configs/tiny.yaml --simulate-rank K --world-size N [key=value ...]

Every parallel dimension comes from the config (parallel.tp/pp/dp/cp/ep/sp/zero/schedule/...); see
docs/configuration.md. Bad input ends with one message on stderr and exit code 2, before any process group.

`--simulate-rank K --world-size N` (no torchrun) runs rank K of the N-rank layout alone on this machine's
device, the first GPU or the CPU: its model shard, optimizer, buckets, streams, offload and kernels are the
real ones at full size, and every collective and pipeline message is answered locally by comm's simulated
backend with finite stand-in values (docs/architecture.md section 2.6). Its JSONL rows (log.jsonl) carry the
rank's measured peak memory and step time and say which rank they simulate, for
`launch/plan.py --compare RUN_JSONL` beside the plan of the same config and world size. Checkpoints are
refused there (validate.check_simulated_config); the loss is the rank's own (0 on stages without the head).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (RUN_ERRORS, USER_ERRORS, build_context, exit_cleanly_on_sigterm, fail,  # noqa: E402
                    load_and_validate, parse_args, shutdown, stage_builder)


def main(argv=None) -> int:
    args, overrides = parse_args("parallel3d pretraining", argv, simulate=True)
    try:
        cfg = load_and_validate(args.config, overrides, args.simulate_rank, args.world_size)
    except USER_ERRORS as e:
        fail(str(e))
    from parallel3d.training.loop import run_training

    exit_cleanly_on_sigterm(cfg)
    ctx = build_context(cfg, args.simulate_rank)
    try:
        run_training(cfg, ctx, stage_builder(cfg, ctx))
    except RUN_ERRORS as e:
        fail(f"[rank {ctx.rank}] {e}", every_rank=True)  # no teardown: peers may be stuck; torchrun ends them
    del ctx  # nothing may hold a process group past shutdown()
    shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
