"""`launch/pretrain.py --simulate-rank K --world-size N`: one rank of a world-64 layout alone on the CPU, through
the command's own main (in this process: no torchrun, no subprocess), then `launch/plan.py --compare` on its
JSONL. The rank's step is real (its model shard, optimizer and buckets on the CPU) and its collectives and
pipeline messages are answered by the simulated backend, so what is asserted is what a user reads: exit 0,
a finite loss and gradient norm in every row (a receive left as torch.empty would not be: the last stage's
loss reads the received hidden states, every earlier stage's gradients the received gradients), the measured
peak memory and step time, and which rank the rows simulate."""
from __future__ import annotations

import json
import math

import pytest
import torch

from parallel3d import comm
from parallel3d.mesh import MeshSpec, ParallelContext

WORLD = 64
SMALL = ["model.hidden_size=32", "model.num_heads=4", "model.num_kv_heads=2", "model.ffn_hidden_size=64",
         "model.num_layers=4", "train.seq_len=32", "train.micro_batch_size=1", "train.steps=2",
         "train.warmup_steps=1", "log.interval=1"]
MOE = ["model.num_experts=8", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32"]
LAYOUTS = {   # world 64 each; ranks: the first of each pipeline stage and the last rank (the last tp/cp/dp/ep)
    "tp2-cp2-pp2-dp8-zero1-sp": (["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.sp=true",
                                  "parallel.zero=1", "train.global_batch_size=16"], [0, 63]),
    "moe-tp2-cp2-pp2-ep4-zero2": (["parallel.tp=2", "parallel.cp=2", "parallel.pp=2", "parallel.ep=4",
                                   "parallel.sp=true", "parallel.zero=2", "train.global_batch_size=16", *MOE],
                                  [0, 32, 63]),
    "interleaved-pp4-dp16-zero3": (["parallel.tp=1", "parallel.pp=4", "parallel.schedule=interleaved",
                                    "parallel.virtual_stages=2", "parallel.zero=3", "model.num_layers=8",
                                    "train.global_batch_size=64"], [0, 16, 32, 63]),
}


@pytest.fixture(autouse=True)
def _keep_the_allocator(monkeypatch):
    """build_context tunes glibc's malloc for a CPU run's process (host_memory.keep_freed_memory); in the
    test process it would keep freed heap for every later test."""
    from launch import pretrain  # noqa: F401 (puts launch/common.py in sys.modules as `common`)
    import common

    monkeypatch.setattr(common, "keep_freed_memory", lambda: False)


def _pretrain(args: list[str]) -> int:
    from launch import pretrain

    return pretrain.main(["--config", "configs/tiny.yaml", *args])


def _simulate(tmp_path, layout: str, rank: int, extra: tuple = ()) -> list[dict]:
    overrides, _ = LAYOUTS[layout]
    path = tmp_path / f"{layout}-{rank}.jsonl"
    code = _pretrain(["--simulate-rank", str(rank), "--world-size", str(WORLD), *SMALL, *overrides,
                      f"log.jsonl={path}", *extra])
    assert code == 0
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_simulated_rank_of_every_stage_trains_finite(tmp_path, layout):
    torch.set_num_threads(1)
    overrides, ranks = LAYOUTS[layout]
    pp = next(int(o.split("=")[1]) for o in overrides if o.startswith("parallel.pp="))
    spec_stage = {r: r // (WORLD // pp) for r in ranks}   # pp is the outermost rank dimension
    for rank in ranks:
        rows = _simulate(tmp_path, layout, rank)
        assert [r["step"] for r in rows] == [1, 2]
        for r in rows:
            assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and not r["skipped"], (rank, r)
            assert r["peak_mem_bytes"] > 0 and r["step_time_s"] > 0
            assert r["simulated"] == {"rank": rank, "world_size": WORLD, "pp_rank": spec_stage[rank],
                                      "device": "cpu"}
            if spec_stage[rank] == pp - 1:   # the head's stage: the loss of its own tokens, a real one
                assert 3.0 < r["loss"] < 7.0, (rank, r["loss"])   # ln(256) = 5.5 at initialisation
            else:
                assert r["loss"] == 0.0   # the loss lives on the last stage (its all-reduce is local)
            assert r["comm_bytes"].get("pp.recv", 0) > 0 and r["comm_bytes"].get("pp.send", 0) > 0
            if "ep=4" in " ".join(overrides):
                assert r["comm_bytes"]["ep.all_to_all"] > 0
                counts = [v for k, v in r.items() if k.startswith("moe_tokens_per_expert.")]
                assert counts and all(sum(c) > 0 for c in counts)


def test_plan_compare_reads_a_simulated_run(tmp_path, capsys):
    from launch import plan as plan_cli

    layout = "tp2-cp2-pp2-dp8-zero1-sp"
    overrides, _ = LAYOUTS[layout]
    timeline = tmp_path / "timeline.json"
    _simulate(tmp_path, layout, 63, (f"log.timeline={timeline}",))
    capsys.readouterr()
    plan_cli.main(["--config", "configs/tiny.yaml", "--world-size", str(WORLD), *SMALL, *overrides,
                   "--compare", str(tmp_path / f"{layout}-63.jsonl"), "--timeline", str(timeline)])
    out = capsys.readouterr().out
    table = {line.split("  ")[0].strip(): line for line in out.splitlines()[out.splitlines().index(
        next(x for x in out.splitlines() if x.startswith("component"))):]}
    assert "simulated rank 63 of 64 (stage 1, cpu), alone: no waits" in table
    for row in ("step time: stage 1's compute + after the pipeline", "stage 1 compute, all microbatches (timeline)",
                "one forward action of stage 1 (compute)", "one backward action of stage 1 (compute)",
                "peak memory of stage 1 (GiB)"):
        assert row in table and " - " not in table[row].split(row)[1][:40], table.get(row)   # both sides read
    assert "pipeline bubble" not in out.split("plan beside the run")[1]   # a rank alone has no bubble
    # on a GPU the run logs max_memory_allocated, the CUDA context outside it: the plan's peak is its tensors
    assert float(table["peak memory of stage 1 (GiB)"].split()[-3]) < 0.1


def test_world_size_of_the_compare_must_be_the_simulated_one(tmp_path, capsys):
    layout = "tp2-cp2-pp2-dp8-zero1-sp"
    overrides, _ = LAYOUTS[layout]
    _simulate(tmp_path, layout, 0)
    from launch import plan as plan_cli

    capsys.readouterr()
    with pytest.raises(SystemExit) as end:
        plan_cli.main(["--config", "configs/tiny.yaml", "--world-size", "128", *SMALL, *overrides,
                       "--compare", str(tmp_path / f"{layout}-0.jsonl")])
    assert end.value.code == 2
    assert "simulated rank 0 of world size 64; plan it at --world-size 64" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--simulate-rank", "64", "--world-size", "64"], "--simulate-rank 64 is outside the world of size 64"),
    (["--simulate-rank", "-1", "--world-size", "64"], "--simulate-rank -1 is outside the world of size 64"),
    (["--simulate-rank", "3"], "--simulate-rank 3 needs --world-size N"),
    (["--world-size", "64"], "--world-size 64 goes with --simulate-rank K"),
    (["--simulate-rank", "0", "--world-size", "12", "parallel.pp=2", "parallel.cp=2"],
     "world size 12 is not divisible by tp*cp*pp=2*2*2=8"),
    (["--simulate-rank", "0", "--world-size", "4", "checkpoint.save_dir=/tmp/x"],
     "checkpoint.save_dir=/tmp/x: --simulate-rank saves and loads no checkpoints"),
])
def test_bad_simulate_rank_input_gives_one_clear_error(args, message, capsys):
    with pytest.raises(SystemExit) as end:
        _pretrain(args)
    err = capsys.readouterr().err
    assert end.value.code == 2 and err.startswith("error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1


def test_simulate_rank_under_torchrun_is_refused(capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as end:
        _pretrain(["--simulate-rank", "1", "--world-size", "4"])
    err = capsys.readouterr().err
    assert end.value.code == 2 and "--simulate-rank runs one rank alone, without torchrun" in err
    assert "WORLD_SIZE=4" in err


def test_simulated_receives_are_filled_with_finite_seeded_values():
    """Every pipeline / ring receive of a simulated rank with values is written (no peer would): NaN-filled
    buffers come out finite, unit-scale and the same on every run; sends are untouched; meta (the planner's
    dry run) is left alone."""
    def exchange(device: str):
        ctx = ParallelContext.simulated(MeshSpec(pp=2, cp=2), 1, device, "gloo")
        send = torch.arange(12.0, device=device).view(3, 4)
        acts = torch.full((3, 4), float("nan"), device=device)
        grads = torch.full((2, 4, 16), float("nan"), device=device)
        ids = torch.full((5,), -1, dtype=torch.int64, device=device)
        pending = comm.start_batch_p2p([comm.P2P("send", send, 0), comm.P2P("recv", acts, 0),
                                        comm.P2P("recv", grads, 0), comm.P2P("recv", ids, 0)], ctx.pp)
        pending.wait()
        return ctx, send, acts, grads, ids

    ctx, send, acts, grads, ids = exchange("cpu")
    assert torch.equal(send, torch.arange(12.0).view(3, 4))
    for buf in (acts, grads):
        assert torch.isfinite(buf).all() and buf.abs().sum() > 0
    assert 0.5 < grads.std().item() < 1.5 and abs(grads.mean().item()) < 0.3
    assert torch.equal(ids, torch.zeros(5, dtype=torch.int64))
    assert ctx.stats.summary() == {("pp", "send"): (1, 48), ("pp", "recv"): (3, 48 + 512 + 40)}
    again = exchange("cpu")
    assert torch.equal(again[2], acts) and torch.equal(again[3], grads)   # seeded: every run alike
    exchange("meta")   # no values: nothing filled, nothing raised


@pytest.mark.gpu
def test_simulated_work_orders_the_device_as_nccl_does():
    """On a GPU a simulated group stands for NCCL: comm.orders_on_device holds (so the gradient sync's side
    stream runs as on a real rank), and a wait on another stream makes that stream wait for the fill."""
    ctx = ParallelContext.simulated(MeshSpec(dp=4), 1, "cuda", "nccl")
    assert comm.orders_on_device(ctx.dp)
    inp = torch.arange(4 * 2 ** 20, dtype=torch.float32, device="cuda")
    out = torch.full((2 ** 20,), float("nan"), device="cuda")
    work = comm.start_reduce_scatter(out, inp, ctx.dp)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        comm.wait_work(work, ctx.dp, "reduce_scatter")
        copy = out.clone()   # (2**20,) read on the side stream after its wait
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(copy, inp[2 ** 20: 2 ** 21])   # this rank's block (fill_reduce_scatter)
    meta = ParallelContext.simulated(MeshSpec(dp=4), 1, "meta", "nccl")
    assert not comm.orders_on_device(meta.dp)   # the planner's dry run: no device to order


@pytest.mark.gpu
def test_simulated_rank_on_the_gpu(tmp_path):
    """A world-64 rank of each of the CPU test's layouts on the GPU: finite, and the peak is CUDA's."""
    for layout, (_, ranks) in LAYOUTS.items():
        for r in _simulate(tmp_path, layout, ranks[-1], ("model.kernels=auto",)):
            assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and not r["skipped"]
            assert r["simulated"]["device"].startswith("cuda") and r["peak_mem_bytes"] > 0


def test_a_data_parallel_rank_alone_trains_as_world_size_1_on_its_data():
    """Where the stand-in is exact, a simulated rank is the real rank: at ZeRO-0 every collective of DP rank 0
    of 64 is an all-reduce, which a rank alone leaves at its local value, so its step is the world-size-1
    step on that rank's own microbatches (the token count is its own, and rank 0 counts every gradient
    element in the norm). Loss, logged gradient norm and weights after three AdamW steps must match."""
    from ckpt_helpers import build_trainer, make_config
    from parity import NORM_RTOL, PARITY_ADAM

    torch.set_num_threads(1)
    adam = [f"train.lr={PARITY_ADAM['lr']}", f"train.eps={PARITY_ADAM['eps']}",
            f"train.weight_decay={PARITY_ADAM['weight_decay']}", "parallel.zero=0", "train.steps=3"]
    sim_cfg = make_config([*adam, "train.global_batch_size=128", "train.micro_batch_size=1"], WORLD)
    ctx = ParallelContext.simulated(MeshSpec(dp=WORLD), 0, "cpu", "gloo")
    alone = build_trainer(sim_cfg, ctx)
    ref = build_trainer(make_config([*adam, "train.global_batch_size=2", "train.micro_batch_size=1"], 1),
                        ParallelContext.single())
    assert sim_cfg.train.num_microbatches == ref.cfg.train.num_microbatches == 2
    ref._microbatches = alone._microbatches   # world size 1 reads what DP rank 0 of 64 reads
    for _ in range(3):
        got, want = alone.train_step(), ref.train_step()
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=NORM_RTOL)
        assert got["comm_bytes"]["dp_cp.all_reduce"] > 0 and not want["comm_bytes"]   # it did communicate
    for p, q in zip((p for c in alone.chunks for p in c.parameters()), (q for c in ref.chunks for q in c.parameters())):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
