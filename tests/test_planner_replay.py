"""Planning this machine op by op (planner/op_replay.py): the dry run's ops are the CPU step's ops, each is
priced at its replayed time (times the ranks' slowdown) plus the host's per-op overhead, and an op that
cannot be replayed falls back to the roofline."""
from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest
import torch

from ckpt_helpers import make_config
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.planner import op_replay, replay_speed
from parallel3d.planner.dryrun import run_role, tracked_step
from parallel3d.planner.hardware import gpu
from parallel3d.planner.host_kernels import as_run_on_cpu
from parallel3d.planner.step_costs import in_order_stretches
from parallel3d.training.trainer import Trainer
from test_planner import _stage_builder


def _cfg():
    return as_run_on_cpu(make_config(["model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=2",
                                      "model.ffn_hidden_size=64", "model.num_layers=2", "model.vocab_size=128",
                                      "train.seq_len=32", "model.max_seq_len=32", "train.global_batch_size=4",
                                      "train.micro_batch_size=2"], 1))


def _signatures(cfg, device: str) -> Counter:
    ctx = (ParallelContext.simulated(MeshSpec(), 0, "meta") if device == "meta"
           else ParallelContext.single(torch.device("cpu")))
    trainer = Trainer(cfg, ctx, _stage_builder(cfg, ctx))
    if device == "cpu":
        trainer.train_step()   # the step the plan stands for is a later one (lr, bias corrections differ)
    _, tracker = tracked_step(trainer, device, signatures=True)
    assert set(tracker.signatures) == {op.key for op in tracker.ops}
    return Counter(op.key for op in tracker.ops)


def test_the_dry_run_replays_the_ops_the_cpu_step_runs():
    """What is replayed is what runs: the stand-in's op signatures are the CPU step's, all but the input
    batch's own layout (the loader's strides), op for op."""
    cfg = _cfg()
    dry, real = _signatures(cfg, "meta"), _signatures(cfg, "cpu")
    shared = sum((dry & real).values())
    assert shared >= 0.97 * sum(real.values())
    assert {k for k in real if k.startswith("aten.mm")} == {k for k in dry if k.startswith("aten.mm")}


def test_a_replayed_op_is_priced_at_its_time_plus_the_host_overhead(tmp_path):
    """A cache that says every mm takes 1 ms: each mm of the plan costs 1 ms x the ranks' slowdown + the
    per-op overhead, and the ops the cache does not hold are priced by the roofline as before."""
    cfg = _cfg()
    base = dataclasses.replace(gpu("h100"), host_op_s=0.0, host_step_op_s=0.0, op_overhead_s=3e-6)
    roofline = run_role(cfg, 0, _stage_builder, base, 8)
    ctx = ParallelContext.simulated(MeshSpec(), 0, "meta")
    out, tracker = tracked_step(Trainer(cfg, ctx, _stage_builder(cfg, ctx)), "meta", signatures=True)
    times = {k: (1e-3 if k.startswith("aten.mm.") else None) for k in tracker.signatures}
    stretches, _ = in_order_stretches(out, tracker, 0)      # the dry run's step: the same ops in the same order
    times.update({op_replay.in_order_key(s, k): None for s in stretches for k in s})   # no time in order
    for extra in (0.0, 2e-4):   # an output written to cold memory costs its replayed extra too
        times.update({op_replay.COLD + k: (extra if k.startswith("aten.mm.") else None)
                      for k in tracker.signatures})
        cache = tmp_path / f"ops-{extra}.json"
        cache.write_text(json.dumps({"version": op_replay.VERSION, "ops": times}))
        device = dataclasses.replace(base, op_times=cache, op_time_scale=1.5)
        replayed = run_role(cfg, 0, _stage_builder, device, 8)
        count, seconds = replayed.op_seconds["mm"]
        assert count == roofline.op_seconds["mm"][0] > 0
        # an mm that allocates its output pays the cold extra too (the fused head's d hidden mm writes in place)
        fresh = sum(1 for op in tracker.ops if op.key.startswith("aten.mm.") and op.fresh_bytes)
        assert 0 < fresh < count
        assert seconds == pytest.approx(count * (1e-3 * 1.5 + 3e-6) + fresh * extra * 1.5)
        for name, (n, s) in roofline.op_seconds.items():
            if name != "mm":
                assert tuple(replayed.op_seconds[name]) == (n, pytest.approx(s))
        assert json.loads(cache.read_text())["ops"] == times   # nothing replayed: the cache had every op


def test_a_small_op_is_priced_at_its_time_in_the_steps_order(tmp_path):
    """Where the cache holds an op's time in the step's order (op_replay.replay_in_order), the dry run
    prices the op at that time, not at its time alone."""
    cfg = _cfg()
    ctx = ParallelContext.simulated(MeshSpec(), 0, "meta")
    out, tracker = tracked_step(Trainer(cfg, ctx, _stage_builder(cfg, ctx)), "meta", signatures=True)
    times = {k: 1e-3 for k in tracker.signatures}
    times.update({op_replay.COLD + k: 0.0 for k in tracker.signatures})
    stretches, _ = in_order_stretches(out, tracker, 0)
    times.update({op_replay.in_order_key(s, k): (4e-3 if k.startswith("aten.mm.") else None)
                  for s in stretches for k in s})
    cache = tmp_path / "ops.json"
    cache.write_text(json.dumps({"version": op_replay.VERSION, "ops": times}))
    device = dataclasses.replace(gpu("h100"), host_op_s=0.0, host_step_op_s=0.0, op_overhead_s=0.0,
                                 op_times=cache, op_time_scale=1.0)
    run = run_role(cfg, 0, _stage_builder, device, 8)
    count, seconds = run.op_seconds["mm"]
    assert seconds == pytest.approx(count * 4e-3)
    n, s = run.op_seconds["add"]
    assert s == pytest.approx(n * 1e-3)


def test_small_ops_are_timed_in_the_steps_order_once_and_cached(tmp_path, monkeypatch):
    """`measure(order=)` times the small ops of the step one after another in its order: each gets a time,
    an op whose tensors exceed ORDER_MAX_BYTES none; a second plan reads them from the cache."""
    cfg = _cfg()
    ctx = ParallelContext.simulated(MeshSpec(), 0, "meta")
    _, tracker = tracked_step(Trainer(cfg, ctx, _stage_builder(cfg, ctx)), "meta", signatures=True)
    order = [op.key for op in tracker.ops]
    big, big_spec = op_replay.signature(torch.ops.aten.add.Tensor, (torch.ones(1 << 19, device="meta"),
                                                                   torch.ones(1 << 19, device="meta")), {})
    specs = {**tracker.signatures, big: big_spec}
    cache = tmp_path / "ops.json"
    stretch = order + [big]
    first = op_replay.measure(specs, cache, [stretch])
    assert first[op_replay.in_order_key(stretch, big)] is None and first[big] > 0   # 4 MiB of inputs: alone only
    assert all(first[op_replay.in_order_key(stretch, k)] > 0 for k in tracker.signatures)   # all small here
    monkeypatch.setattr(op_replay, "replay_in_order", lambda *a: pytest.fail("timed a cached order again"))
    assert op_replay.measure(specs, cache, [stretch]) == first


def test_an_ops_time_in_order_is_kept_per_step(tmp_path, monkeypatch):
    """The same signature in another step's order is timed again in that order: its time depends on the ops
    around it (op_replay.in_order_key), so a plan never reads one timed in another model's step."""
    cfg = _cfg()
    ctx = ParallelContext.simulated(MeshSpec(), 0, "meta")
    _, tracker = tracked_step(Trainer(cfg, ctx, _stage_builder(cfg, ctx)), "meta", signatures=True)
    order = [op.key for op in tracker.ops]
    cache = tmp_path / "ops.json"
    orders = []
    monkeypatch.setattr(op_replay, "replay_in_order",
                        lambda specs, o, **kw: orders.append(list(o)) or {k: 1e-6 * len(orders) for k in o})
    first = op_replay.measure(tracker.signatures, cache, [order])
    other = order[::-1]                                  # the same ops around one another differently
    second = op_replay.measure(tracker.signatures, cache, [other])
    assert orders == [order, other]
    assert op_replay.measure(tracker.signatures, cache, [order]) == first and len(orders) == 2   # each cached
    assert op_replay.in_order_key(order, order[0]) != op_replay.in_order_key(other, order[0])
    assert first[op_replay.in_order_key(order, order[0])] == pytest.approx(1e-6)
    assert second[op_replay.in_order_key(other, order[0])] == pytest.approx(2e-6)


def test_ops_are_timed_in_order_per_action_and_a_repeated_action_once(tmp_path, monkeypatch):
    """The dry run cuts the step's ops by action (op_replay.segments): the two microbatches' forwards are
    one stretch of ops, timed in order once, and every op of the step has the key of its own stretch."""
    assert op_replay.segments(list("abcde"), [0, 0, 1, 1, 0]) == [["a", "b"], ["c", "d"], ["e"]]
    cfg = _cfg()   # two microbatches
    ctx = ParallelContext.simulated(MeshSpec(), 0, "meta")
    out, tracker = tracked_step(Trainer(cfg, ctx, _stage_builder(cfg, ctx)), "meta", signatures=True)
    stretches, prefixes = in_order_stretches(out, tracker, 0)
    assert [k for s in stretches for k in s] == [op.key for op in tracker.ops] and len(prefixes) == len(tracker.ops)
    distinct = {op_replay.in_order_key(s, ""): s for s in stretches}
    assert len(stretches) >= 5 and len(distinct) < len(stretches)   # fwd, bwd, fwd, bwd, the rest: fwd twice
    timed = []
    monkeypatch.setattr(op_replay, "replay_in_order", lambda specs, o, **kw: timed.append(list(o)) or {k: 1e-6 for k in o})
    found = op_replay.measure(tracker.signatures, tmp_path / "ops.json", stretches)
    assert sorted(map(tuple, timed)) == sorted(map(tuple, distinct.values()))
    assert all(op_replay.replayed_seconds(found, op.key, p) == pytest.approx(1e-6)
               for op, p in zip(tracker.ops, prefixes))


def test_replays_are_kept_at_the_speed_of_the_caches_reference(tmp_path, monkeypatch):
    """This VM's speed moves under load from outside, and an op's one replay caught whichever spell it fell
    in (tiny's dp2 plans priced the GEMMs they share with pp2 at 1.45x). Each replay is now scaled by a probe
    timed just before it against the cache's reference probe (planner/replay_speed.py). Here every timed
    call takes 1 ms on a machine running at half the reference's speed: every op, alone and in order, is
    kept at 0.5 ms; a later plan's replays into the same cache are set against the same reference. Every
    timed call still runs on one thread with denormals flushed (op_replay._one_thread): the probe between
    passes must not undo that."""
    flushes = torch.set_flush_denormal(True)
    torch.set_flush_denormal(False)
    denormal = torch.tensor([1e-39])

    class Clock:   # every timed call: 1 ms
        now = 0.0

        def perf_counter(self) -> float:
            assert torch.get_num_threads() == 1
            assert not flushes or (denormal * 1.0).item() == 0.0
            self.now += 1e-3
            return self.now

    class HalfSpeed:
        def reference(self, *a) -> float:
            return 1e-3

        def __call__(self) -> float:
            return 2e-3

    class FullSpeed(HalfSpeed):
        def reference(self, *a) -> float:
            pytest.fail("measured a new reference for a cache that has one")

        def __call__(self) -> float:
            return 1e-3

    cfg = _cfg()
    ctx = ParallelContext.simulated(MeshSpec(), 0, "meta")
    _, tracker = tracked_step(Trainer(cfg, ctx, _stage_builder(cfg, ctx)), "meta", signatures=True)
    order = [op.key for op in tracker.ops]
    monkeypatch.setattr(op_replay, "time", Clock())
    monkeypatch.setattr(op_replay.replay_speed, "Probe", HalfSpeed)
    cache = tmp_path / "ops.json"
    first = op_replay.measure(tracker.signatures, cache, [order])
    assert all(first[k] == pytest.approx(5e-4) for k in tracker.signatures)
    assert all(first[op_replay.in_order_key(order, k)] == pytest.approx(5e-4) for k in tracker.signatures)
    assert json.loads(cache.read_text())["speed_s"] == 1e-3
    monkeypatch.setattr(op_replay.replay_speed, "Probe", FullSpeed)
    add, spec = op_replay.signature(torch.ops.aten.add.Tensor, (torch.ones(3), torch.ones(3)), {})
    second = op_replay.measure({**tracker.signatures, add: spec}, cache, [order])
    assert second[add] == pytest.approx(1e-3) and second[tracker.ops[0].key] == first[tracker.ops[0].key]


def test_a_plan_says_when_the_machine_runs_off_the_caches_speed(tmp_path, monkeypatch):
    """Every cached op time is kept at the cache's reference probe, so a cache measured under load (a 0.41 ms
    reference against 0.25 quiet: tiny's plans 1.4-2.2x high) or a machine loaded now misprices the whole
    plan without a word. speed_note sets the probe now (the fastest of three short medians, on one thread)
    against the cache's and names the cache past 25% either way; within it, nothing."""
    cache = tmp_path / "ops.json"
    seen = []

    class Probe:   # this machine's probe now: 0.25 ms, but one slow spell
        def reference(self, seconds) -> float:
            seen.append((seconds, torch.get_num_threads()))
            return 0.40e-3 if len(seen) == 2 else 0.25e-3

    monkeypatch.setattr(op_replay.replay_speed, "Probe", Probe)
    assert op_replay.speed_note(cache) is None   # no cache yet
    for reference, words in ((0.413e-3, "1.65x faster"), (0.15e-3, "1.67x slower"), (0.29e-3, None)):
        seen.clear()
        cache.write_text(json.dumps({"version": op_replay.VERSION, "speed_s": reference, "ops": {}}))
        note = op_replay.speed_note(cache)
        assert seen == [(replay_speed.CHECK_S, 1)] * 3
        if words is None:
            assert note is None
        else:
            assert words in note and str(cache) in note and "--reprofile" in note and "load average" in note
    cache.write_text(json.dumps({"version": op_replay.VERSION - 1, "speed_s": 1.0, "ops": {}}))
    assert op_replay.speed_note(cache) is None   # a cache of another version is replayed afresh anyway


def test_ops_missing_from_the_cache_are_replayed_once_and_cached(tmp_path, monkeypatch):
    cfg = _cfg()
    ctx = ParallelContext.simulated(MeshSpec(), 0, "meta")
    _, tracker = tracked_step(Trainer(cfg, ctx, _stage_builder(cfg, ctx)), "meta", signatures=True)
    cache = tmp_path / "ops.json"
    first = op_replay.measure(tracker.signatures, cache)
    assert first.keys() == tracker.signatures.keys() | {op_replay.COLD + k for k in tracker.signatures}
    assert all(first[k] is not None and first[k] > 0 for k in tracker.signatures)   # every op of a Llama step
    assert all(v is None or v >= 0 for k, v in first.items() if k.startswith(op_replay.COLD))
    monkeypatch.setattr(op_replay, "replay", lambda spec, *a: pytest.fail("replayed an op the cache holds"))
    monkeypatch.setattr(op_replay, "replay_cold_output", lambda spec, *a: pytest.fail("replayed a cached output"))
    assert op_replay.measure(tracker.signatures, cache) == first
    assert json.loads(cache.read_text())["version"] == op_replay.VERSION


def test_an_op_that_cannot_run_on_replay_values_has_no_time():
    """Integer inputs replay as zeros (indices in range); an op they break is left to the roofline."""
    key, spec = op_replay.signature(torch.ops.aten.remainder.Tensor,
                                    (torch.ones(4, dtype=torch.int64, device="meta"),
                                     torch.ones(4, dtype=torch.int64, device="meta")), {})
    assert op_replay.replay(spec) is None
    assert op_replay.measure({key: spec}) == {key: None, op_replay.COLD + key: None}


def test_replay_values_keep_square_roots_real_and_strides_as_recorded():
    """Second moments are non-negative in training; a replayed sqrt of negatives (NaNs) ran 80x slower."""
    x = op_replay._tensor((3, 4), (0, 1), torch.float32)   # an expanded tensor, as autograd passes them
    assert x.stride() == (0, 1) and bool((x >= 0.5).all()) and bool((x < 1.5).all())
    key_meta, _ = op_replay.signature(torch.ops.aten.sqrt.default, (torch.empty(8, device="meta"),), {})
    key_cpu, _ = op_replay.signature(torch.ops.aten.sqrt.default, (torch.empty(8),), {})
    key_strided, _ = op_replay.signature(torch.ops.aten.sqrt.default, (torch.empty(16)[::2],), {})
    assert key_meta == key_cpu != key_strided


def test_reuse_distance_is_the_traffic_since_an_input_was_last_touched():
    from parallel3d.planner.tracker import StepTracker

    x = torch.ones(256)                      # 1 KiB, made before the step: never touched in it
    tracker = StepTracker(device_type="cpu", signatures={})
    with tracker:
        y = x + 1                            # reads x, writes y: 2 KiB moved
        z = y * 3                            # y was just written
        x + z                                # since x was last touched, the mul moved 2 KiB
    assert [op.reuse for op in tracker.ops] == [((1024, -1),), ((1024, 0),), ((1024, 2048), (1024, 0))]


def test_inputs_from_beyond_the_cache_cost_the_memory_they_come_from():
    """A replayed op ran with its inputs in cache: each input the step touched longer ago than the cache
    holds (or never) adds its bytes at the measured extra cost; an op larger than the cache gets nothing
    (it streamed from memory when replayed)."""
    from parallel3d.planner.step_costs import cold_seconds
    from parallel3d.planner.tracker import OpCost

    dev = dataclasses.replace(gpu("h100"), cache_bytes=10_000, cold_s_per_byte=1e-9)
    op = OpCost(0.0, 0.0, 4000.0, torch.float32, False, reuse=((1000, -1), (1000, 20_000), (1000, 9_000)))
    assert cold_seconds(op, dev) == pytest.approx(2000 * 1e-9)
    assert cold_seconds(dataclasses.replace(op, nbytes=20_000.0), dev) == 0.0


def test_an_op_writes_its_fresh_output_to_cold_memory():
    """The tracker records the bytes of the output storages an op allocates; an op that allocates its output
    (replayed into the buffer its last call used) costs its replayed extra of writing it into memory
    outside the cache, as a step's allocator places it; an in-place op allocates nothing. The extra is
    measured per signature (a step here paid 0.35 ns per output byte over the replay for GEMMs, about 0.1
    for muls), through the op's `.out` overload, for outputs of at least COLD_MIN_BYTES."""
    from parallel3d.planner.step_costs import cold_seconds
    from parallel3d.planner.tracker import StepTracker

    a, w, acc = torch.ones(512, 256), torch.ones(256, 128), torch.zeros(512, 128)
    with StepTracker(device_type="cpu", signatures={}) as tracker:
        out = a @ w                          # (64, 16): a fresh 4 KiB output
        acc.addmm_(a, w)                     # in place: nothing allocated
        out + acc                            # a fresh output, not a GEMM's
    assert [(op.name, op.fresh_bytes) for op in tracker.ops] == [("mm", 262144), ("addmm_", 0), ("add", 262144)]
    dev = dataclasses.replace(gpu("h100"), cache_bytes=1 << 20, cold_s_per_byte=1e-9)
    hot = [dataclasses.replace(op, reuse=()) for op in tracker.ops]   # inputs just touched: no input term
    assert [cold_seconds(op, dev, 5e-6) for op in hot] == [5e-6, 0.0, 5e-6]
    mm, add = (tracker.signatures[tracker.ops[i].key] for i in (0, 2))
    assert op_replay.replay_cold_output(mm) >= 0.0 and op_replay.replay_cold_output(add) >= 0.0   # both measured
    small = op_replay.signature(torch.ops.aten.mm.default, (torch.ones(8, 8), torch.ones(8, 8)), {})[1]
    assert op_replay.replay_cold_output(small) is None   # a small output comes back hot from the allocator


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_the_fill_that_stands_for_the_network_is_not_priced_as_compute(backend):
    """A dry run's collective fills its output in place of the network (comm.transfer_stand_ins); the
    collective's own price covers those bytes, so the tracker prices none of the fill's copies. Its buffers
    are still counted, and what a real gloo rank computes on its own thread is still an op: the sum on wait
    of the reduce-scatter and the copy of its own block into the all-gather's output (none in place)."""
    from parallel3d import comm
    from parallel3d.planner.tracker import StepTracker

    ctx = ParallelContext.simulated(MeshSpec(dp=2), 0, "meta", backend)
    with StepTracker(device_type="meta") as tracker:
        x = torch.ones(4096, device="meta")                        # (4096,)
        gathered = comm.all_gather(x, ctx.dp)                      # (8192,)
        swapped = comm.all_to_all(x, ctx.dp)                       # (4096,)
        shard = comm.reduce_scatter(x, ctx.dp)                     # (2048,)
        buffer = torch.ones(8192, device="meta")                   # (8192,): rank 0's block is the first half
        comm.wait_work(comm.start_all_gather(buffer, buffer[:4096], ctx.dp), ctx.dp, "all_gather")
    names = Counter(op.name for op in tracker.ops)
    assert names["copy_"] == (1 if backend == "gloo" else 0), names
    if backend == "gloo":
        copy = next(op for op in tracker.ops if op.name == "copy_")
        assert copy.nbytes == 3 * 4 * 4096   # one block: as any op, its arguments (block, x) and its result
    assert names["sum"] == (1 if backend == "gloo" else 0), names
    assert gathered.shape == (8192,) and swapped.shape == (4096,) and shard.shape == (2048,)
    comm_bytes = sum(a.nbytes for a in tracker.allocs if a.category == "comm_buffers")
    # the gathered output, the all-to-all's output and the reduce-scatter's output (gloo: and its receive buffer)
    assert comm_bytes == 4 * (8192 + 4096 + 2048 + (4096 if backend == "gloo" else 0))


def test_replays_flush_denormals_and_restore_the_thread():
    """An in-place op replayed over the same values thousands of times (in the step's order) decays them into
    the denormal range, 50x slower on x86, where a training step's data never go: replays flush them to
    zero, and the thread is as it was afterwards."""
    supported = torch.set_flush_denormal(True)
    torch.set_flush_denormal(False)
    if not supported:
        pytest.skip("this CPU cannot flush denormals")
    tiny = torch.tensor([1e-39])                       # a float32 denormal
    threads = torch.get_num_threads()
    with op_replay._one_thread():
        assert torch.get_num_threads() == 1
        assert (tiny * 1.0).item() == 0.0              # flushed
    assert (tiny * 1.0).item() > 0.0 and torch.get_num_threads() == threads
