"""Pipeline step time vs torch.distributed.pipelining, and measured vs simulated bubble, per schedule.

    python benchmarks/pipeline.py [--pps 2 4] [--microbatches 8] [--layers 8] [--hidden 64]
                                  [--seq 64] [--micro-batch 2] [--iters 5] [--out pipeline.png]
                                  [--schedules 1f1b zb-h1 zb-v dualpipe-v] [--simulate-only]

First a pure table: every schedule's simulated bubble with equal per-chunk costs (F = I = W = 1,
B = 2; a chunk of a two-chunk schedule holds half a stage, so the fractions compare directly) and
its peak activations in stages (1F1B: p on rank 0), with the runtime's lazy sends.

Then, for each schedule and pipeline size, the same tiny Llama is split evenly into stages
(embedding and head add no extra layers; two chunks per rank for the V schedules, placed as
``placement.py`` says) and one training step of ``m`` microbatches runs with our runtime
(``run_pipeline_step``) and, where torch has the schedule (1F1B, GPipe, ZB-V as
``ScheduleZBVZeroBubble``, DualPipe-V as ``ScheduleDualPipeV``), with ``torch.distributed.pipelining``
(``PipelineStage`` per chunk, each wrapped as a plain module of one tensor argument), taking turns
in every iteration so both see the same machine load. The table prints the median step time
(slowest rank) of ours (sends finished lazily, the default), ours with every send waited where it
is posted ("strict", the verifier's model), pipelining's, and the ratio ours / pipelining.

Bubble: one of our steps is recorded (``record=``) into a measured ``Timeline``; the simulator
replays the same schedule with the measured average cost of each (rank, action kind) and free
communication. The gap between the two is communication and scheduling overhead the simulator
does not model. ``--out`` writes the simulated and measured Gantt charts of the last run side by
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


def _model_parts(w, shape: dict, schedule: str):
    """This rank's chunks of the shared Llama (even split, the schedule's placement) and the step's
    microbatches."""
    from parallel3d.models.config import ModelConfig
    from parallel3d.models.llama import Llama
    from parallel3d.mesh import MeshSpec
    from parallel3d.pipeline import chunks_per_rank, partition_layers, placement_of, stage_ids

    ctx = w.context(MeshSpec(pp=w.world_size))
    cfg = ModelConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], num_heads=4,
                      num_kv_heads=2, ffn_hidden_size=4 * shape["hidden"],
                      num_layers=shape["layers"], kernels="torch")
    pp, v = ctx.spec.pp, chunks_per_rank(schedule, 2)
    stages = partition_layers(cfg.num_layers, pp, v, embedding_cost=0, head_cost=0)
    chunks = []
    for s in stage_ids(ctx.coords.pp, pp, v, placement_of(schedule)):
        chunks.append(Llama(cfg, ctx, layers=stages[s], pre=s == 0, post=s == pp * v - 1))
        chunks[-1].init_weights(0)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (shape["m"], shape["b"], shape["seq"] + 1), generator=g)
    mbs = [{"ids": t[:, :-1], "labels": t[:, 1:], "position_ids": torch.arange(shape["seq"])}
           for t in tokens]
    return ctx, chunks, mbs


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


THEIRS = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe", "interleaved": "ScheduleInterleaved1F1B",
          "zb-v": "ScheduleZBVZeroBubble", "dualpipe-v": "ScheduleDualPipeV"}


def _theirs(ctx, chunks: list[nn.Module], mbs: list[dict], schedule: str):
    """A step function running torch.distributed.pipelining on the same chunks and data."""
    import torch.distributed.pipelining as pipelining
    from parallel3d.pipeline import placement_of, stage_ids

    pp, r, m = ctx.spec.pp, ctx.coords.pp, len(mbs)
    n = pp * len(chunks)
    tokens = sum(mb["labels"].numel() for mb in mbs)
    ids_of = stage_ids(r, pp, len(chunks), placement_of(schedule))
    stages = [pipelining.PipelineStage(_Stage(c, mbs[0]["position_ids"]), s, n, ctx.device,
                                       group=ctx.pp.pg) for c, s in zip(chunks, ids_of)]

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # (b, s, V), (b, s)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                           reduction="sum") / tokens

    cls = getattr(pipelining, THEIRS[schedule])
    sched = cls(stages if len(stages) > 1 else stages[0], m, loss_fn=loss_fn, scale_grads=False)
    ids = torch.cat([mb["ids"] for mb in mbs])        # (m*b, s): pipelining splits dim 0
    labels = torch.cat([mb["labels"] for mb in mbs])
    first, last = 0 in ids_of, n - 1 in ids_of

    def step() -> None:
        for c in chunks:
            c.zero_grad(set_to_none=True)
        args = (ids,) if first else ()
        kwargs = dict(target=labels, return_outputs=False) if last else {}
        sched.step(*args, **kwargs)
    return step


def _bench(w, shape: dict, schedule: str, iters: int) -> dict:
    from parallel3d.pipeline.runtime import ScheduleCache, run_pipeline_step

    ctx, chunks, mbs = _model_parts(w, shape, schedule)
    cache = ScheduleCache()
    tokens = sum(mb["labels"].numel() for mb in mbs)

    def ours(lazy_sends: bool = True, record=None):
        for c in chunks:
            c.zero_grad(set_to_none=True)
        run_pipeline_step(ctx, chunks, schedule, mbs, loss_scale=1.0 / tokens,
                          backward=lambda loss: loss.backward(), record=record, schedules=cache,
                          lazy_sends=lazy_sends)

    fns = {"ours": ours, "strict": lambda: ours(False)}
    if schedule in THEIRS:
        fns["theirs"] = _theirs(ctx, _model_parts(w, shape, schedule)[1], mbs, schedule)
    times = _timed(ctx, fns, iters)
    record: list = []
    ours(record=record)
    return {"times": times, "record": record}


def _step_time(per_rank: list[dict], name: str) -> float:
    """Median over iterations of the slowest rank's step time."""
    return statistics.median(max(ts) for ts in zip(*(r["times"][name] for r in per_rank)))


def _bubbles(per_rank: list[dict], schedule: str, p: int, m: int):
    from parallel3d.pipeline import build_schedule, chunks_per_rank
    from parallel3d.pipeline.timeline import breakdown, mean_costs, measured_and_simulated

    records = [rec for r in per_rank for rec in r["record"]]
    sched = build_schedule(schedule, p, m, chunks_per_rank(schedule, 2))
    measured, simulated = measured_and_simulated(records, sched)
    return measured, simulated, mean_costs(records), breakdown(records, p)


def simulated_table(pps: list[int], m: int) -> None:
    """Every schedule's bubble with equal per-chunk costs, and its peak activations in stages."""
    from fractions import Fraction

    from parallel3d.pipeline import (SCHEDULE_NAMES, ActionKind as K, build_schedule, chunks_per_rank,
                                     peak_in_flight, simulate)

    unit = {K.FORWARD: 1, K.BACKWARD: 2, K.BACKWARD_INPUT: 1, K.BACKWARD_WEIGHT: 1}
    print(f"simulated, m={m}, F=I=W=1 B=2 per chunk, lazy sends: bubble / peak activations (stages)")
    print(f"{'schedule':>12} " + " ".join(f"{f'pp={p}':>16}" for p in pps))
    for name in SCHEDULE_NAMES:
        v = chunks_per_rank(name, 2)
        cells = []
        for p in pps:
            try:
                sched = build_schedule(name, p, m, v)
            except ValueError:
                cells.append(f"{'-':>16}")
                continue
            bubble = simulate(sched, unit, lazy_sends=True).bubble_fraction
            peak = Fraction(max(peak_in_flight(s) for s in sched), v)
            cells.append(f"{float(bubble):>9.1%} / {float(peak):<4g}")
        print(f"{name:>12} " + " ".join(cells))


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
    ap.add_argument("--schedules", nargs="+",
                    default=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"],
                    choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe-v"])
    ap.add_argument("--simulate-only", action="store_true", help="only the simulated table")
    ap.add_argument("--out", default=None, help="side-by-side Gantt PNG (last run)")
    args = ap.parse_args()
    simulated_table(args.pps, args.microbatches)
    if args.simulate_only:
        return
    from parallel3d.pipeline import ActionKind as K, plot_side_by_side
    from parallel3d.testing import WorldPool

    shape = dict(vocab=args.vocab, hidden=args.hidden, layers=args.layers, seq=args.seq,
                 b=args.micro_batch, m=args.microbatches)
    print(f"\nLlama hidden={args.hidden} layers={args.layers} vocab={args.vocab} seq={args.seq} "
          f"micro_batch={args.micro_batch} m={args.microbatches}, gloo CPU, "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    print(f"{'schedule':>11} {'pp':>3} {'ours ms':>8} {'strict ms':>10} {'pipelining ms':>14} "
          f"{'ratio':>6} {'bubble meas.':>13} {'bubble sim.':>12}  F/B/I/W ms per rank (those run)")
    pool = WorldPool(backend="gloo")
    last = None
    try:
        for schedule in args.schedules:
            for p in args.pps:
                res = pool.run(p, _bench, shape, schedule, args.iters, timeout=900)
                t_ours, t_strict = _step_time(res, "ours"), _step_time(res, "strict")
                theirs = _step_time(res, "theirs") if schedule in THEIRS else float("nan")
                measured, simulated, avg, spent = _bubbles(res, schedule, p, args.microbatches)
                costs = " ".join("/".join(f"{avg[(r, k)] * 1e3:.1f}" for k in (K.FORWARD, K.BACKWARD,
                                          K.BACKWARD_INPUT, K.BACKWARD_WEIGHT) if (r, k) in avg)
                                 for r in range(p))
                print(f"{schedule:>11} {p:>3} {t_ours * 1e3:>8.1f} {t_strict * 1e3:>10.1f} "
                      f"{theirs * 1e3:>14.1f} {t_ours / theirs:>6.2f} "
                      f"{float(measured.bubble_fraction):>13.1%} "
                      f"{float(simulated.bubble_fraction):>12.1%}  {costs}", flush=True)
                total = sum(spent[0].values())
                print(f"{'':>15} where the recorded step went, % per rank (compute/recv wait/send/"
                      f"between actions/outside): " + "  ".join(
                          "/".join(f"{100 * row[k] / total:.0f}" for k in row) for row in spent), flush=True)
                last = (schedule, p, measured, simulated)
    finally:
        pool.close()
    if args.out and last:
        schedule, p, measured, simulated = last
        path = plot_side_by_side(simulated, measured, args.out,
                                 (f"simulated {schedule} p={p} (measured action costs)",
                                  f"measured {schedule} p={p}, gloo CPU (seconds)"))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
