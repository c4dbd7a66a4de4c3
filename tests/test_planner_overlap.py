"""A collective started beside compute hides only behind what the rank does between its start and its wait
(planner/cost.exposed_in_action), with the waits the dry run meets marked by comm.SimulatedWork. The rule
before priced each action's overlapped traffic against all of the action's compute, before the start
included, so ZeRO-3's root gather (waited at once) and each gather longer than its unit hid for free."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ckpt_helpers import make_config
from parallel3d import comm
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.planner.cost import exposed_in_action
from parallel3d.planner.dryrun import run_role
from parallel3d.planner.hardware import gpu
from test_planner import SMALL, _stage_builder


def test_a_collective_hides_only_between_its_start_and_its_wait():
    def ops(*seconds):
        return [("op", s) for s in seconds]

    def start(key, seconds, link="dp"):
        return [("start", key, link, seconds)]

    def wait(key):
        return [("wait", key)]

    assert exposed_in_action(ops(1) + start(1, 3.0) + ops(1) + wait(1) + ops(8)) == pytest.approx(2.0)
    assert exposed_in_action(ops(1) + start(1, 3.0) + ops(4) + wait(1) + ops(5)) == 0.0   # covered
    # what the rank pays at the call holds the stream before the transfer starts
    assert exposed_in_action([("block", 1.0)] + start(1, 3.0) + ops(3) + wait(1)) == 0.0
    assert exposed_in_action(start(1, 3.0) + [("block", 1.0)] + ops(1) + wait(1)) == pytest.approx(1.0)
    # one link carries one transfer at a time; two links run side by side
    assert exposed_in_action(start(1, 2.0) + start(2, 2.0) + ops(3) + wait(2) + ops(7)) == pytest.approx(1.0)
    assert exposed_in_action(start(1, 2.0) + start(2, 2.0, "cp") + ops(3) + wait(2)) == 0.0
    # a stall moves everything after it: the second transfer starts at 3, is waited for at 4
    assert exposed_in_action(start(1, 3.0) + ops(1) + wait(1) + start(2, 3.0) + ops(1) + wait(2)) == pytest.approx(4.0)
    # never waited (a reduction followed up once done): it may run to the action's end, no further
    assert exposed_in_action(ops(8) + start(1, 3.0) + ops(2)) == pytest.approx(1.0)
    assert exposed_in_action(ops(1) + wait(7) + ops(1)) == 0.0   # its start was in another action
    # ZeRO-3's forward: the root's gather waited at once, each unit's gather waited one unit later
    units = start(0, 1.0) + wait(0) + start(1, 1.5) + ops(2) + wait(1) + start(2, 1.5) + ops(2) + wait(2) + ops(2)
    assert exposed_in_action(units) == pytest.approx(1.0)
    # a wait holds the stream, not the host: a host-bound action (ops issued 1 s apart, 0.1 s each) absorbs
    # a stall that ends before the host has issued what follows it
    late = start(1, 3.0) + ops(0.1) + wait(1) + ops(0.1, 0.1, 0.1, 0.1)
    assert exposed_in_action(late, host_op_s=1.0) == 0.0
    assert exposed_in_action(start(1, 6.0) + late[1:], host_op_s=1.0) == pytest.approx(6.4 - 5.1)


def test_a_dry_run_marks_the_waits_it_meets_and_not_the_follow_ups_it_polled():
    """comm's simulated backend hands back a handle per started collective: waiting for it reports the
    call's number (CommStats.serial); a handle polled complete first (the gradient sync's follow-ups) does
    not, nor does a second wait; the stand-in's own work on wait (gloo's sum) still runs."""
    ctx = ParallelContext.simulated(MeshSpec(dp=2), 0, "cpu", "gloo")
    group, seen = ctx.groups()["dp_cp"], []
    ctx.stats.on_wait = seen.append
    full, out = torch.zeros(8), torch.zeros(4)
    gather = comm.start_all_gather(full, torch.ones(4), group)
    comm.wait_work(gather, group, "all_gather")
    comm.wait_work(gather, group, "all_gather")
    assert seen == [ctx.stats.serial] and torch.equal(full, torch.ones(8))
    scatter = comm.start_reduce_scatter(out, torch.arange(8.0), group)
    assert scatter.is_completed()
    comm.wait_work(scatter, group, "reduce_scatter")
    assert seen == [ctx.stats.serial - 1] and torch.equal(out, 2 * torch.arange(4.0))   # summed over 2 "ranks"
    pending = comm.start_batch_p2p([comm.P2P("send", torch.ones(2), 1), comm.P2P("recv", torch.ones(2), 1)], group)
    pending.wait()
    assert seen[1:] == [ctx.stats.serial - 1, ctx.stats.serial]


def test_zero3_gathers_are_exposed_where_their_unit_cannot_cover_them():
    """A small Llama at dp2 ZeRO-3 on an H100 whose links are slowed until the forward's gathers take most of its
    compute: the whole-action rule hid them all; the root's gather (waited at once) and each gather longer
    than the unit before it are now waited for, and the plan's step is that much longer."""
    h100 = dataclasses.replace(gpu("h100"), host_op_s=0.0)   # device-bound (a stall is not absorbed)
    cfg = make_config(["parallel.zero=3", "parallel.tp=1", *SMALL], 2)
    fast = run_role(cfg, 1, _stage_builder, h100, 8).actions[("FORWARD", 0)]
    slower = 0.8 * fast.compute_s / fast.overlapped_comm_s   # the gathers at 0.8x the forward's compute
    slow_gpu = dataclasses.replace(h100, nvlink_bytes_per_s=h100.nvlink_bytes_per_s / slower,
                                   nvlink_latency_s=h100.nvlink_latency_s * slower)
    forward = run_role(cfg, 1, _stage_builder, slow_gpu, 8).actions[("FORWARD", 0)]
    assert forward.overlapped_comm_s == pytest.approx(0.8 * forward.compute_s, rel=0.05)
    assert forward.blocking_comm_s == 0.0   # a GPU runs them all beside its compute
    root_share = 1 / (cfg.model.num_layers + 1)   # at least the root's gather, a unit's share or more
    assert forward.overlapped_comm_s > forward.exposed_comm_s > root_share * forward.overlapped_comm_s
    assert forward.time_s == pytest.approx(forward.compute_s + forward.exposed_comm_s)


def test_collectives_started_beside_compute_pay_the_wake_extra_too():
    """gloo on a CPU whose ranks fill its cores: ZeRO-3's gathers, started after a unit's compute, met the
    peer's late arrival and gloo's sleeping threads as a blocking call does (two ranks, 172 KiB after 3 ms
    of matmul: 1.3 ms a start on average against 0.4 at the median), yet only blocking calls were charged
    the profile's wake extra. Each started gather is now charged it, in proportion to the compute since the
    rank's last collective, as the blocking ones are (cost.wake_seconds)."""
    cfg = make_config(["parallel.zero=3", "parallel.tp=1", *SMALL], 2)
    h100 = gpu("h100")
    woken = dataclasses.replace(h100, comm_wake_s={"all_gather": 2e-3}, comm_wake_gap_s=1e-12)
    base, paid = (run_role(cfg, 0, _stage_builder, g, 8).comm_s["dp_cp.all_gather"] for g in (h100, woken))
    calls = (paid - base) / 2e-3
    assert calls == pytest.approx(round(calls)) and round(calls) >= cfg.model.num_layers * 2   # forward, backward


def test_the_sends_and_receives_of_one_batch_are_priced_as_one_transfer():
    """Ring attention posts each step's send and receive as one batch (comm.start_batch_p2p), and they travel
    side by side; gloo's send probe times exactly such a pair. The dry run priced the send and the receive
    each at the pair's time, twice the batch. Now a batch inside a compute action lasts its longest transfer
    (CommStats.batch marks the calls that join one). A pipeline's send and receive actions keep each
    message's price: the schedule simulator pairs each message's two ends itself."""
    ctx = ParallelContext.simulated(MeshSpec(cp=2), 0, "cpu", "gloo")
    group = ctx.groups()["cp"]
    comm.start_batch_p2p([comm.P2P("send", torch.ones(2), 1), comm.P2P("recv", torch.ones(2), 1)], group).wait()
    assert ctx.stats.batch == ctx.stats.serial - 1                 # the receive joined the send's batch
    comm.start_batch_p2p([comm.P2P("recv", torch.ones(2), 1)], group).wait()
    assert ctx.stats.batch == ctx.stats.serial                     # a batch of its own
    cfg = make_config(["parallel.cp=2", "parallel.cp_mode=ring", "parallel.tp=1", "parallel.zero=0", *SMALL], 2)
    comm_s = run_role(cfg, 0, _stage_builder, gpu("h100"), 8).comm_s
    assert comm_s["cp.send"] > 0 and comm_s.get("cp.recv", 0.0) == 0.0   # same-sized pairs: the send's time
    pp = make_config(["parallel.pp=2", "parallel.tp=1", "parallel.zero=0", *SMALL], 2)
    comm_s = run_role(pp, 0, _stage_builder, gpu("h100"), 8).comm_s   # activations out, their gradients in
    assert comm_s["pp.send"] > 0 and comm_s["pp.recv"] == pytest.approx(comm_s["pp.send"])


def test_a_posted_pipeline_groups_messages_are_priced_in_their_own_actions():
    """1F1B's steady state posts a microbatch's activation send and the gradient receive of an earlier one
    as one group, and the runtime records both actions with the post's window. The dry run put both messages
    into the window's later action (RECV_GRAD), so SEND_ACT's mean per message was diluted (some SEND_ACT
    actions held nothing) and RECV_GRAD's swollen, and the schedule simulator, which pairs each message's
    two ends, priced them so. Each message now goes to the action of its own direction."""
    pp = make_config(["parallel.pp=2", "parallel.tp=1", "parallel.zero=0", *SMALL], 2)
    first = run_role(pp, 0, _stage_builder, gpu("h100"), 8)    # activations out, their gradients in
    assert set(first.p2p_s) == {"SEND_ACT", "RECV_GRAD"}
    assert first.p2p_s["SEND_ACT"] == pytest.approx(first.p2p_s["RECV_GRAD"])   # same-sized messages
    last = run_role(pp, 1, _stage_builder, gpu("h100"), 8)
    assert last.p2p_s["RECV_ACT"] == pytest.approx(last.p2p_s["SEND_GRAD"]) == pytest.approx(first.p2p_s["SEND_ACT"])
