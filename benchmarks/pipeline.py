"""Pipeline step time vs torch.distributed.pipelining, and measured vs simulated bubble.

    python benchmarks/pipeline.py [--pps 2 4] [--microbatches 8] [--layers 8] [--hidden 64]
                                  [--seq 64] [--micro-batch 2] [--iters 5] [--out pipeline.png]

For each pipeline size the same tiny Llama is split evenly into stages (embedding and head add no
extra layers) and one training step of ``m`` microbatches runs under 1F1B twice: with our runtime
(``run_pipeline_step``) and with ``torch.distributed.pipelining`` (``PipelineStage`` +
``Schedule1F1B``, each stage wrapped as a plain module of one tensor argument), taking turns in
every iteration so both see the same machine load. The table prints the median step time (slowest
rank) of ours (sends finished lazily, the default), ours with every send waited where it is posted
("strict", the verifier's model), pipelining's, and the ratio ours / pipelining.

Bubble: one of our steps is recorded (``record=``) into a measured ``Timeline``; the simulator
replays the same schedule with the measured average cost of each (rank, action kind) and free
communication. The gap between the two is communication and scheduling overhead the simulator
does not model. ``--out`` writes the simulated and measured Gantt charts of the largest pp side by
side. Runs on gloo CPU with one thread per rank: with fewer cores than ranks, ranks share cores
and both runtimes pay for it alike. Timings are never asserted anywhere.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch import nn  # noqa: E402


def _model_parts(w, shape: dict):
    """This rank's stage of the shared Llama (even split) and the step's microbatches."""
    from models.config import ModelConfig
    from models.llama import Llama
    from parallel3d.mesh import MeshSpec
    from parallel3d.pipeline import partition_layers

    ctx = w.context(MeshSpec(pp=w.world_size))
    cfg = ModelConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_heads=4,
                      num_kv_heads=2, ffn_hidden_size=4 * shape["hidden"],
                      num_layers=shape["layers"], kernels="torch")
    pp, r = ctx.spec.pp, ctx.coords.pp
    stages = partition_layers(cfg.num_layers, pp, embedding_cost=0, head_cost=0)
    chunk = Llama(cfg, ctx, layers=stages[r], pre=r == 0, post=r == pp - 1)
    chunk.init_weights(0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (shape["m"], shape["b"], shape["seq"] + 1), generator=g)
    mbs = [{"ids": t[:, :-1], "labels": t[:, 1:], "position_ids": torch.arange(shape["seq"])}
           for t in tokens]
    return ctx, chunk, mbs


def _timed(ctx, fns: dict, iters: int) -> dict[str, list[float]]:
    """Seconds per call of each fn on this rank. The runtimes take turns inside every iteration
    (each call started together after a barrier) so that they see the same machine load."""
    from parallel3d import comm

    out: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(iters + 2):  # two warm-up rounds
        for name, fn in fns.items():
            comm.barrier(ctx.world)
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                out[name].append(time.perf_counter() - t0)
    comm.barrier(ctx.world)
    return out


class _Stage(nn.Module):
    """One tensor in, one tensor out, as torch.distributed.pipelining expects: ids or hidden
    states in; hidden states or full-vocabulary logits out (the loss is pipelining's loss_fn)."""

    def __init__(self, chunk: nn.Module, positions: torch.Tensor) -> None:
        super().__init__()
        self.chunk = chunk
        self.register_buffer("positions", positions, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.chunk(x, self.positions)


def _theirs(ctx, chunk: nn.Module, mbs: list[dict], schedule: str):
    """A step function running torch.distributed.pipelining on the same stage and data."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    pp, r, m = ctx.spec.pp, ctx.coords.pp, len(mbs)
    tokens = sum(mb["labels"].numel() for mb in mbs)
    stage = PipelineStage(_Stage(chunk, mbs[0]["position_ids"]), r, pp, ctx.device,
                          group=ctx.pp.pg)

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # (b, s, V), (b, s)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                           reduction="sum") / tokens

    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
    sched = cls(stage, m, loss_fn=loss_fn, scale_grads=False)
    ids = torch.cat([mb["ids"] for mb in mbs])        # (m*b, s): pipelining splits dim 0
    labels = torch.cat([mb["labels"] for mb in mbs])

    def step() -> None:
        chunk.zero_grad(set_to_none=True)
        if r == 0:
            sched.step(ids)
        elif r == pp - 1:
            sched.step(target=labels, return_outputs=False)
        else:
            sched.step()
    return step


def _bench(w, shape: dict, schedule: str, iters: int) -> dict:
    from parallel3d.pipeline.runtime import ScheduleCache, run_pipeline_step

    ctx, chunk, mbs = _model_parts(w, shape)
    _, their_chunk, _ = _model_parts(w, shape)
    cache = ScheduleCache()
    tokens = sum(mb["labels"].numel() for mb in mbs)

    def ours(lazy_sends: bool = True, record=None):
        chunk.zero_grad(set_to_none=True)
        run_pipeline_step(ctx, [chunk], schedule, mbs, loss_scale=1.0 / tokens,
                          backward=lambda loss: loss.backward(), record=record, schedules=cache,
                          lazy_sends=lazy_sends)

    times = _timed(ctx, {"ours": ours, "strict": lambda: ours(False),
                         "theirs": _theirs(ctx, their_chunk, mbs, schedule)}, iters)
    record: list = []
    ours(record=record)
    return {"times": times, "record": record}


def _step_time(per_rank: list[dict], name: str) -> float:
    """Median over iterations of the slowest rank's step time."""
    return statistics.median(max(ts) for ts in zip(*(r["times"][name] for r in per_rank)))


def _bubbles(per_rank: list[dict], schedule: str, p: int, m: int):
    from parallel3d.pipeline import build_schedule
    from parallel3d.pipeline.timeline import mean_costs, measured_and_simulated

    records = [rec for r in per_rank for rec in r["record"]]
    measured, simulated = measured_and_simulated(records, build_schedule(schedule, p, m))
    return measured, simulated, mean_costs(records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    ap.add_argument("--out", default=None, help="side-by-side Gantt PNG (largest pp)")
    args = ap.parse_args()
    from parallel3d.pipeline import ActionKind as K, plot_side_by_side
    from parallel3d.testing import WorldPool

    shape = dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, seq=args.seq,
                 b=args.micro_batch, m=args.microbatches)
    print(f"Llama hidden={args.hidden} layers={args.layers} vocab={args.vocab} seq={args.seq} "
          f"micro_batch={args.micro_batch} m={args.microbatches} {args.schedule}, gloo CPU, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'pp':>3} {'ours ms':>8} {'strict ms':>10} {'pipelining ms':>14} {'ratio':>6} "
          f"{'bubble meas.':>13} {'bubble sim.':>12} {'(p-1)/(m+p-1)':>14}  F/B ms per rank")
    pool = WorldPool(backend="gloo")
    last = None
    try:
        for p in args.pps:
            res = pool.run(p, _bench, shape, args.schedule, args.iters, timeout=900)
            t_ours, t_strict, t_theirs = (_step_time(res, k) for k in ("ours", "strict", "theirs"))
            measured, simulated, avg = _bubbles(res, args.schedule, p, args.microbatches)
            ideal = (p - 1) / (args.microbatches + p - 1)
            costs = " ".join(f"{avg[(r, K.FORWARD)] * 1e3:.1f}/{avg[(r, K.BACKWARD)] * 1e3:.1f}"
                             for r in range(p))
            print(f"{p:>3} {t_ours * 1e3:>8.1f} {t_strict * 1e3:>10.1f} {t_theirs * 1e3:>14.1f} "
                  f"{t_ours / t_theirs:>6.2f} "
                  f"{float(measured.bubble_fraction):>13.1%} {float(simulated.bubble_fraction):>12.1%}"
                  f" {ideal:>14.1%}  {costs}")
            last = (p, measured, simulated)
    finally:
        pool.close()
    if args.out and last:
        p, measured, simulated = last
        path = plot_side_by_side(simulated, measured, args.out,
                                 (f"simulated {args.schedule} p={p} (measured action costs)",
                                  f"measured {args.schedule} p={p}, gloo CPU (seconds)"))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
