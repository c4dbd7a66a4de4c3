"""parallel.ep_overlap on gloo: the measured timeline of a pair against its parts run apart.

    python benchmarks/ep_overlap.py [--ranks 2 --hidden 256 --experts 8 --seq 512 --microbatches 8 --steps 3]

Trains the same MoE model through the real Trainer twice on `--ranks` gloo CPU processes (dp = ep = ranks,
1F1B at pp 1), once plain and once with `parallel.ep_overlap=true`, and records the last step's timeline
(`train_step(record=...)`). Apart, each forward and backward waits for its own expert all-to-alls; paired
(pipeline/pairing.py), each all-to-all travels while the partner computes (interleave.py). Table: the mean
forward and backward apart, the mean span of a pair (first turn's start to last turn's end), the span over
the sum of its parts, and the step times. Timings are medians/means of one machine's run, never asserted;
`--tiny` runs a seconds-long version whose table a test checks for shape only.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from parallel3d.mesh import MeshSpec  # noqa: E402
from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.training.config import load_config  # noqa: E402
from parallel3d.training.validate import resolve_and_validate  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def overrides(args, overlap: bool) -> list[str]:
    h = args.hidden
    return [f"model.hidden_size={h}", f"model.num_layers={args.layers}", "model.num_heads=4", "model.num_kv_heads=4",
            f"model.ffn_hidden_size={2 * h}", f"model.num_experts={args.experts}", "model.moe_top_k=2",
            f"model.moe_ffn_hidden_size={2 * h}", "model.kernels=torch", f"model.max_seq_len={args.seq}",
            "parallel.tp=1", f"parallel.ep={args.ranks}", f"train.seq_len={args.seq}", "train.micro_batch_size=1",
            f"train.global_batch_size={args.microbatches * args.ranks}", "train.precision=fp32",
            f"parallel.ep_overlap={'true' if overlap else 'false'}"]


def _worker(w, args, overlap: bool) -> dict:
    from parallel3d.models.moe import MoETransformer
    from parallel3d.training.trainer import Trainer

    torch.set_num_threads(args.threads)
    cfg = resolve_and_validate(load_config(os.path.join(ROOT, "configs/tiny.yaml"), overrides(args, overlap),
                                           ModelConfig), w.world_size)
    ctx = w.context(MeshSpec.of(cfg.parallel))

    def build(layers, pre, post):
        return MoETransformer(cfg.model, ctx, layers=layers, pre=pre, post=post)
    trainer = Trainer(cfg, ctx, build)
    steps, record = [], []
    for i in range(args.steps):
        t0 = time.perf_counter()
        trainer.train_step(record=record if i == args.steps - 1 else None)
        steps.append(time.perf_counter() - t0)
    return {"step_s": statistics.median(steps[1:] or steps), "rows": [(a.kind.name, a.microbatch, s, e)
                                                                      for _, a, s, e in record if a.kind.is_compute]}


def summarise(apart: dict, paired: dict) -> dict:
    """Mean forward / backward seconds apart, mean pair span, span over the sum of its parts (per rank's rows)."""
    def durations(kind: str) -> list:
        return [e - s for k, _, s, e in apart["rows"] if k == kind]
    fwd, bwd = statistics.mean(durations("FORWARD")), statistics.mean(durations("BACKWARD"))
    turns: dict = {}
    for kind, mb, s, e in paired["rows"]:
        turns.setdefault((kind, mb), []).append((s, e))
    # a pair: actions with more than one turn, joined with the partner whose turns interleave with them
    spans, seen = [], set()
    multi = [k for k, v in turns.items() if len(v) > 1]
    for key in multi:
        if key in seen:
            continue
        start, end = min(s for s, _ in turns[key]), max(e for _, e in turns[key])
        partner = next((k for k in multi if k != key and k not in seen and k[0] != key[0]
                        and min(s for s, _ in turns[k]) < end and max(e for _, e in turns[k]) > start), None)
        if partner is None:
            continue
        seen |= {key, partner}
        both = turns[key] + turns[partner]
        spans.append(max(e for _, e in both) - min(s for s, _ in both))
    span = statistics.mean(spans) if spans else float("nan")
    return {"forward_s": fwd, "backward_s": bwd, "pairs": len(spans), "pair_span_s": span,
            "ratio": span / (fwd + bwd), "step_apart_s": apart["step_s"], "step_paired_s": paired["step_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="a seconds-long run (tests check the table's shape)")
    args = p.parse_args()
    if args.tiny:
        args.hidden, args.seq, args.microbatches, args.steps, args.experts = 32, 32, 4, 2, 4
    from parallel3d.testing import WorldPool

    pool = WorldPool(backend="gloo")
    try:
        apart = pool.run(args.ranks, _worker, args, False, timeout=900)
        paired = pool.run(args.ranks, _worker, args, True, timeout=900)
    finally:
        pool.close()
    rows = [summarise(a, b) for a, b in zip(apart, paired)]
    print(f"ep_overlap on gloo: {args.ranks} ranks (dp = ep), 1F1B pp 1, {args.microbatches} microbatches, hidden "
          f"{args.hidden}, {args.layers} MoE layers, {args.experts} experts top-2, seq {args.seq}, "
          f"{args.threads} thread(s) per rank, torch {torch.__version__}")
    print("\n| rank | F apart ms | B apart ms | pairs | pair span ms | span / (F + B) | step apart ms "
          "| step paired ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r, row in enumerate(rows):
        print(f"| {r} | {row['forward_s'] * 1e3:.1f} | {row['backward_s'] * 1e3:.1f} | {row['pairs']} | "
              f"{row['pair_span_s'] * 1e3:.1f} | {row['ratio']:.2f} | {row['step_apart_s'] * 1e3:.0f} | "
              f"{row['step_paired_s'] * 1e3:.0f} |")


if __name__ == "__main__":
    main()
