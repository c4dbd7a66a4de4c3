"""Check a node or a cluster before training on it: every parallel dimension against world size 1, and the
bus bandwidth of each kind of group.

    torchrun --nproc_per_node=8 launch/selftest.py [--only NAME[,NAME]] [--steps N] [--quick] [--json PATH]

Each layout of parallel3d/selfcheck/layouts.py (TP, TP+SP, every pipeline schedule, ZeRO-0..3, HSDP, the three
context-parallel modes, EP with ep == dp, packed documents and their combinations) trains a tiny Llama for a
few steps on all ranks through the real Trainer, and every rank runs the same config at world size 1 on its
own device; the losses, logged grad norms and weights after the steps must agree (selfcheck/parity.py).
Layouts the world cannot hold are skipped with the reason. Then the collectives of the tp, dp, cp, ep and pp
groups are timed as bus bandwidth beside the planner's figure for this GPU (selfcheck/bandwidth.py).
One table is printed (selfcheck/report.py). Exit 0: every layout ok or skipped; 1: a mismatch or a failed
layout, named on the table's last line; 2: bad arguments. The same command runs on CPUs with gloo.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from common import fail, shutdown, stage_builder  # noqa: E402
from parallel3d import comm  # noqa: E402
from parallel3d.mesh import MeshSpec, ParallelContext, init_distributed  # noqa: E402
from parallel3d.models.config import ModelConfig  # noqa: E402
from parallel3d.selfcheck import bandwidth, layouts, parity, report  # noqa: E402
from parallel3d.training.config import ConfigError, load_config  # noqa: E402
from parallel3d.training.validate import resolve_and_validate  # noqa: E402

PRESET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny.yaml")
MIB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="parallel3d selftest: every layout against world size 1, "
                                     "and each group's bus bandwidth", epilog=f"layouts: {', '.join(layouts.NAMES)}")
    parser.add_argument("--only", help="comma-separated layout names or patterns (pp2-*) to run, in table order")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per layout (default 3)")
    parser.add_argument("--quick", action="store_true", help="2 steps and small bandwidth buffers")
    parser.add_argument("--bandwidth-mib", type=float, default=None,
                        help="buffer size of the bandwidth rows (default 64 on GPUs, 4 on CPUs; 0: none)")
    parser.add_argument("--json", help="also write the table as JSON to this path (rank 0)")
    parser.add_argument("--list", action="store_true", help="print the layout names and exit")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="collective timeout (default 300 s)")
    # test-only: every gradient of this layout's distributed run doubled, so its grad norm must be reported
    parser.add_argument("--inject-mismatch", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.quick:
        args.steps = min(args.steps, 2)
    return args


def make_config(overrides: list[str], world: int):
    return resolve_and_validate(load_config(PRESET, overrides, ModelConfig), world)


def spec_of(cfg) -> MeshSpec:
    return MeshSpec.of(cfg.parallel)   # (the one config -> mesh constructor: etp, HSDP, nodes)


def build_trainer(cfg, ctx: ParallelContext):
    from parallel3d.training.trainer import Trainer

    return Trainer(cfg, ctx, stage_builder(cfg, ctx))


def double_gradients(trainer) -> None:
    """--inject-mismatch: this trainer's loss doubled on its way into backward (its optimizer's scale_loss,
    which every Trainer path calls), so every gradient is x2: the losses and the clipped AdamW weights
    cannot see it; the grad norm must."""
    scale = trainer.optimizer.scale_loss
    trainer.optimizer.scale_loss = lambda loss: 2 * scale(loss)


class Session:
    """One rank's selftest: the world-size-1 runs (one per model and batch, on this rank's device), the context
    of the last mesh (consecutive layouts of one mesh share its process groups, as the test harness's worlds
    do), and the bandwidth rows."""

    def __init__(self, args, world: int, device: torch.device, sizes: tuple[int, int], planner) -> None:
        self.args, self.world, self.device, self.sizes, self.planner = args, world, device, sizes, planner
        self.references: dict = {}
        self.bandwidths: list[dict] = []
        self.spec, self.ctx = None, None
        self.gpus_per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))

    def context(self, spec: MeshSpec) -> ParallelContext:
        if spec != self.spec:
            self.close()
            self.spec, self.ctx = spec, ParallelContext.build(spec, device=self.device, timeout_s=self.args.timeout_s)
        return self.ctx

    def close(self) -> None:
        if self.ctx is not None:
            gc.collect()                   # the last trainer's hooks hold the groups
            comm.barrier(self.ctx.world)   # every rank is done with the groups before any destroys them
            self.ctx.destroy()
        self.spec, self.ctx = None, None

    def reference(self, overrides: list[str]) -> dict:
        key = tuple(overrides)
        if key not in self.references:
            cfg = make_config(overrides, 1)
            self.references[key] = parity.train(build_trainer(cfg, ParallelContext.single(self.device)),
                                                self.args.steps)
        return self.references[key]

    def run(self, layout) -> dict:
        row = {"name": layout.name, "mesh": "", "result": "", "errors": {}, "seconds": 0.0, "mismatches": []}
        reason = layout.skip_reason(self.world)
        if reason:
            return {**row, "result": reason}
        try:
            node = [f"parallel.gpus_per_node={self.gpus_per_node}"]   # the launcher's node, as a run's
            cfg = make_config(layouts.overrides_at(layout, self.world) + node, self.world)
            ref_overrides = layouts.reference_overrides(layout, self.world)
            make_config(ref_overrides, 1)
        except ConfigError as e:   # the same on every rank: the layout list is wrong for this world
            return {**row, "result": f"error: refused: {e}"}
        row["mesh"] = layouts.mesh_words(cfg.parallel)
        reference = self.reference(ref_overrides)
        ctx = self.context(spec_of(cfg))
        start = time.perf_counter()
        trainer = build_trainer(cfg, ctx)
        if layout.name == self.args.inject_mismatch:
            double_gradients(trainer)
        run = parity.train(trainer, self.args.steps)
        row["seconds"] = time.perf_counter() - start
        del trainer
        summaries = comm.all_gather_json(parity.local_summary(run, reference), ctx.world)
        row["mismatches"], row["errors"] = parity.verdict(summaries, reference)
        row["result"] = "MISMATCH" if row["mismatches"] else "ok"
        self.measure(layout, ctx)
        return row

    def measure(self, layout, ctx: ParallelContext) -> None:
        nbytes, iters = self.sizes
        for item in (layout.bandwidth if nbytes else ()):
            dim, op = item.split(":")
            if getattr(ctx, dim).size < 2:
                continue
            row = bandwidth.measure(ctx, dim, op, nbytes, iters)
            self.bandwidths.append({**row, "layout": layout.name,
                                    "link": bandwidth.link_words(row["ranks"], self.gpus_per_node),
                                    "planner_busbw": bandwidth.planner_busbw(row, self.planner[0], self.gpus_per_node)})


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        chosen = layouts.select(args.only.split(",") if args.only else None)
    except ValueError as e:
        fail(str(e))
    if args.inject_mismatch and args.inject_mismatch not in layouts.NAMES:
        fail(f"--inject-mismatch: no layout named {args.inject_mismatch}")
    if args.list:
        print("\n".join(layout.name for layout in chosen))
        return 0
    local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    torch.set_num_threads(max(1, torch.get_num_threads() // local))   # the cores shared, as pretrain.py's ranks
    rank, world = init_distributed(timeout_s=args.timeout_s)
    if world < 2:
        fail("the selftest compares layouts of 2 or more ranks with world size 1: start it under torchrun, "
             "e.g. torchrun --nproc_per_node=8 launch/selftest.py")
    import torch.distributed as dist
    backend = dist.get_backend() if dist.is_initialized() else "none"
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    if device.type == "cpu":
        from parallel3d.host_memory import keep_freed_memory
        keep_freed_memory()
    mib = args.bandwidth_mib if args.bandwidth_mib is not None else (64 if device.type == "cuda" else 4)
    sizes = (int(mib * MIB / (16 if args.quick else 1)), 2 if args.quick else 5)
    planner = bandwidth.planner_device(device, world)
    session = Session(args, world, device, sizes, planner)
    rows = []
    started = time.perf_counter()
    for layout in chosen:
        try:
            rows.append(session.run(layout))
        except Exception as e:   # peers may be stuck in a collective: say which layout, and let torchrun end them
            import traceback
            traceback.print_exc()
            fail(f"[rank {rank}] selftest layout {layout.name} failed: {type(e).__name__}: {e}", code=1,
                 every_rank=True)
    session.close()
    bandwidths = session.bandwidths
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    m, t = (c := make_config(layouts.reference_overrides(layouts.LAYOUTS[0], world), 1)).model, c.train
    header = (f"parallel3d selftest: world {world} ({backend}, {name}), {args.steps} steps per layout of a Llama "
              f"(hidden {m.hidden_size}, {m.num_layers} layers, seq {t.seq_len}, global batch {t.global_batch_size}) "
              f"vs world size 1; {time.perf_counter() - started:.0f} s")
    failed = [r["name"] for r in rows if r["result"] == "MISMATCH" or r["result"].startswith("error")]
    if rank == 0:
        print(report.table(rows, bandwidths, header, planner[1]), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "backend": backend, "device": name, "steps": args.steps,
                           "planner": planner[1], "layouts": rows, "bandwidth": bandwidths, "failed": failed}, f,
                          indent=1)
    shutdown()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
