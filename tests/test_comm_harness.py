"""Collectives, accounting and the multi-process harness (gloo)."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from parallel3d import comm
from parallel3d.mesh import MeshSpec
from parallel3d.testing import WorldError

ROOT = Path(__file__).resolve().parents[1]


def _collectives(w):
    ctx = w.context(MeshSpec(dp=w.world_size))
    g, r, n = ctx.dp, w.rank, w.world_size
    x = torch.full((2, 3), float(r + 1))
    summed = comm.all_reduce(x.clone(), g)
    gathered = comm.all_gather(torch.tensor([float(r)]), g)
    gathered_dim1 = comm.all_gather(torch.full((2, 1), float(r)), g, dim=1)
    scattered = comm.reduce_scatter(torch.arange(2.0 * n).reshape(n, 2) + r, g)
    # uneven all-to-all: rank r sends (j + 1) rows to rank j, each row tagged with the sender
    out_splits = [r + 1] * n
    in_splits = [j + 1 for j in range(n)]
    sent = torch.cat([torch.full((j + 1,), float(r)) for j in range(n)])
    received = comm.all_to_all(sent, g, out_splits, in_splits)
    # batched p2p ring
    nxt, prv = g.ranks[(r + 1) % n], g.ranks[(r - 1) % n]
    buf = torch.empty(4)
    comm.batch_p2p([comm.P2P("send", torch.full((4,), float(r)), nxt), comm.P2P("recv", buf, prv)], g)
    return summed, gathered, gathered_dim1, scattered, received, buf, ctx.stats.summary()


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_and_accounting(worlds, n):
    for r, (summed, gathered, gd1, scattered, received, buf, stats) in enumerate(worlds.run(n, _collectives)):
        assert torch.equal(summed, torch.full((2, 3), float(n * (n + 1) // 2)))
        assert torch.equal(gathered, torch.arange(float(n)))
        assert torch.equal(gd1, torch.arange(float(n)).expand(2, n))
        full = sum(torch.arange(2.0 * n).reshape(n, 2) + k for k in range(n))
        assert torch.equal(scattered, full[r:r + 1])
        assert torch.equal(received, torch.arange(float(n)).repeat_interleave(r + 1))
        assert torch.equal(buf, torch.full((4,), float((r - 1) % n)))
        assert stats[("dp", "all_reduce")] == (1, 2 * 3 * 4)
        assert stats[("dp", "all_gather")] == (2, n * 4 + 2 * n * 4)
        assert stats[("dp", "reduce_scatter")] == (1, 2 * n * 4)
        assert stats[("dp", "all_to_all")] == (1, sum(range(1, n + 1)) * 4)
        assert stats[("dp", "send")] == (1, 16) and stats[("dp", "recv")] == (1, 16)


def _collectives_before_torch_2_13(w):
    """torch < 2.13 has only all_gather_into_tensor / reduce_scatter_tensor (the GPU image runs 2.11). Those
    are NCCL's path: on gloo comm runs its own (comm/gloo.py), so that choice is switched off here."""
    import torch.distributed as dist
    saved = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")
             if hasattr(dist, name)}
    for name in saved:
        delattr(dist, name)
    on_gloo, comm.collectives.on_gloo = comm.collectives.on_gloo, lambda group: False
    try:
        return _collectives(w)
    finally:
        comm.collectives.on_gloo = on_gloo
        for name, fn in saved.items():
            setattr(dist, name, fn)


def test_collectives_run_on_torch_before_2_13(worlds):
    new, old = worlds.run(2, _collectives), worlds.run(2, _collectives_before_torch_2_13)
    for a, b in zip(new, old):
        for x, y in zip(a[:-1], b[:-1]):
            assert torch.equal(x, y)


def _gloo_against_native(w):
    """comm's gloo reduce-scatter and all-gather against gloo's own, on random data of several dtypes, with
    three gathers and a tag-0 point-to-point ring in flight on the one group at once."""
    ctx = w.context(MeshSpec(dp=w.world_size))
    g, r, n = ctx.dp, w.rank, w.world_size
    assert comm.on_gloo(g)
    torch.manual_seed(r)
    out = {}
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        x = (torch.rand(n * 37) * 100).to(dtype)
        shards = [(torch.rand(11 + k) * 100).to(dtype) for k in range(3)]
        fulls = [torch.empty(n * s.numel(), dtype=dtype) for s in shards]
        works = [comm.start_all_gather(f, s, g) for f, s in zip(fulls, shards)]
        ring = comm.start_batch_p2p([comm.P2P("send", shards[0], g.ranks[(r + 1) % n]),
                                     comm.P2P("recv", torch.empty_like(shards[0]), g.ranks[(r - 1) % n])], g)
        seg = torch.empty(37, dtype=dtype)
        rs = comm.start_reduce_scatter(seg, x, g) if dtype.is_floating_point else None
        for work in reversed(works):
            comm.wait_work(work, g, "all_gather")
        ring.wait()
        if rs is not None:
            comm.wait_work(rs, g, "reduce_scatter")
        on_gloo, comm.collectives.on_gloo = comm.collectives.on_gloo, lambda group: False
        try:
            native = [comm.all_gather(s, g) for s in shards]
            native_seg = comm.reduce_scatter(x, g) if rs is not None else None
        finally:
            comm.collectives.on_gloo = on_gloo
        out[str(dtype)] = (fulls, native, seg if rs is not None else None, native_seg)
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_gloo_collectives_match_gloos_own(worlds, n):
    for rank_out in worlds.run(n, _gloo_against_native):
        for dtype, (fulls, native, seg, native_seg) in rank_out.items():
            for a, b in zip(fulls, native):
                assert torch.equal(a, b), dtype
            if seg is not None:   # the sum's order may differ from gloo's: exact at 2 ranks
                assert torch.equal(seg, native_seg) if n == 2 else torch.allclose(seg.float(), native_seg.float(),
                                                                                  rtol=1e-2), dtype


def _hang(w):
    ctx = w.context(MeshSpec(dp=w.world_size))
    if w.rank == 0:
        comm.all_reduce(torch.ones(1), ctx.dp)  # rank 1 never joins
    return w.rank


def test_hung_collective_fails_with_rank_and_op(worlds):
    with pytest.raises(WorldError) as info:
        worlds.run(2, _hang, timeout=5)
    msg = str(info.value)
    assert "timed out after 5s" in msg and "rank 0 still running" in msg and "all_reduce on dp group" in msg
    assert worlds.run(2, _echo) == [0, 1]  # the pool recovers with a fresh world


def _raise_on_rank1(w):
    if w.rank == 1:
        raise ValueError("boom on purpose")
    return w.rank


def _echo(w):
    return w.rank


def test_failing_rank_reports_traceback(worlds):
    with pytest.raises(WorldError) as info:
        worlds.run(2, _raise_on_rank1, timeout=30)
    assert "rank 1 raised" in str(info.value) and "boom on purpose" in str(info.value)
    assert worlds.run(2, _echo) == [0, 1]


def test_single_rank_groups_short_circuit():
    from parallel3d.mesh import ParallelContext

    ctx = ParallelContext.single()
    x = torch.ones(3)
    assert comm.all_reduce(x, ctx.tp) is x and comm.all_gather(x, ctx.dp) is x
    assert ctx.stats.summary() == {}


_HELD: dict = {}   # on each rank: the process groups of the contexts a call built, for the next call to check


def _build_three_contexts(w):
    import torch.distributed as dist

    from parallel3d.testing import CACHED_CONTEXTS

    specs = [MeshSpec(dp=2, tp=2), MeshSpec(tp=4), MeshSpec(pp=2, dp=2)]
    assert len(specs) > CACHED_CONTEXTS
    for spec in specs:
        ctx = w.context(spec)
        ctx.clone("dp")
        _HELD[spec] = [g.pg for g in (*ctx.groups().values(), *ctx._clones.values())
                       if g is not None and g.pg not in (None, dist.group.WORLD)]
    return len(_HELD[specs[0]])


def _live(pg) -> bool:
    """Whether process group `pg` still exists on this rank (not destroyed)."""
    import torch.distributed as dist

    try:
        dist.get_process_group_ranks(pg)
        return True
    except (ValueError, KeyError, RuntimeError):
        return False


def _which_groups_live(w):
    alive = {str(spec): [_live(pg) for pg in pgs] for spec, pgs in _HELD.items()}
    last = list(_HELD)[-1]
    cached = w.context(last)
    summed = comm.all_reduce(torch.ones(1), cached.dp)    # the kept context still works
    _HELD.clear()
    return alive, summed.item()


def test_a_world_keeps_only_its_recent_contexts_between_calls(worlds):
    """Each gloo process group keeps a thread polling its sockets every 10 ms: a world destroys the groups of
    the contexts used least recently (ParallelContext.destroy) once more than CACHED_CONTEXTS are cached."""
    from parallel3d.testing import CACHED_CONTEXTS

    assert CACHED_CONTEXTS == 2 and all(n > 0 for n in worlds.run(4, _build_three_contexts))
    for alive, summed in worlds.run(4, _which_groups_live):
        first, *kept = alive.values()
        assert not any(first), alive            # the oldest context's groups and its clone: destroyed
        assert all(all(k) for k in kept), alive
        assert summed == 2.0


def _groups_left(w):
    alive = [_live(pg) for pgs in _HELD.values() for pg in pgs]
    _HELD.clear()
    summed = comm.all_reduce(torch.ones(1), w.context(MeshSpec(dp=4)).dp)   # a mesh built again works
    return w._contexts.keys() - {(MeshSpec(dp=4), False)}, alive, summed.item()


def test_idle_worlds_keep_only_their_default_groups_between_modules(worlds):
    """IDLE_NOTE: after each test module (the plugin's module fixture) every world destroys its cached
    contexts' groups, so a world idle while the next module runs polls only its default group's sockets."""
    assert all(n > 0 for n in worlds.run(4, _build_three_contexts))
    worlds.release_groups()
    for cached, alive, summed in worlds.run(4, _groups_left):
        assert cached == set() and alive and not any(alive) and summed == 4.0


def _destroy_twice(w):
    from parallel3d.mesh import ParallelContext

    ctx = ParallelContext.build(MeshSpec(dp=2, cp=2))
    ctx.clone("dp")
    ctx.destroy()
    ctx.destroy()    # nothing left to destroy
    try:             # a destroyed group refuses a collective instead of running it on the default group
        comm.all_reduce(torch.ones(1), ctx.dp)
        refused = ""
    except comm.CollectiveError as e:
        refused = str(e)
    return [g.pg for g in ctx.groups().values() if g is not None], ctx._clones, refused


def test_destroy_leaves_no_process_group_behind(worlds):
    for pgs, clones, refused in worlds.run(4, _destroy_twice):
        assert pgs and all(pg is None for pg in pgs) and clones == {}
        assert "all_reduce on dp group" in refused and "destroyed" in refused, refused


def _state(pid: int) -> str:
    """The kernel's one-letter state of a process ("T": stopped, "Z": dead, awaiting its reaper; "": gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def _settles(pids: list[int], states: tuple, within_s: float = 10.0) -> list[str]:
    """The processes' states once all are in `states`, or when `within_s` has passed."""
    deadline = time.monotonic() + within_s
    while any(_state(pid) not in states for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    return [_state(pid) for pid in pids]


def _rank(w):
    return w.rank


def _busy_then_rank(w):
    total = comm.all_reduce(torch.ones(1), w.context(MeshSpec(dp=2)).dp)
    return w.rank, total.item()


ORPHAN = """
import os, signal, sys
from parallel3d.worlds import WorldPool
from test_comm_harness import _rank
if __name__ == "__main__":
    pool = WorldPool()
    pool.run(1, _rank)   # (one rank: each start-up costs 2 CPU-seconds)
    print(*[p.pid for w in pool.worlds.values() for p in w.procs], flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)   # a test process killed outright (a CI timeout, the OOM killer)
    # "exit": a plain exit without pool.close(), multiprocessing ending its daemon ranks
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="worlds are stopped between calls on Linux only")
def test_idle_worlds_are_stopped_between_calls_and_die_with_their_parent(worlds, tmp_path):
    """World.pause: between calls a gloo world's ranks are stopped (their groups' threads wake every 10 ms),
    the next call runs them again, a test process killed outright takes its stopped ranks with it, and one
    that exits without closing its pool still exits (multiprocessing's SIGTERM needs a running rank)."""
    for _ in range(3):
        assert worlds.run(2, _busy_then_rank) == [(0, 2.0), (1, 2.0)]
        pids = [p.pid for p in worlds.worlds[(2, "gloo")].procs]
        assert _settles(pids, ("T",)) == ["T", "T"]   # (a signal lands asynchronously)
    script = tmp_path / "orphan.py"
    script.write_text(ORPHAN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    for end, code in (("kill", -signal.SIGKILL), ("exit", 0)):
        # (a stopped rank would hold the output pipe open, or the exit's join would wait: the timeout fails it)
        out = subprocess.run([sys.executable, str(script), end], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == code, (end, out.stderr[-2000:])
        orphans = [int(pid) for pid in out.stdout.split()]
        assert len(orphans) == 1
        assert set(_settles(orphans, ("", "Z"))) <= {"", "Z"}, end
