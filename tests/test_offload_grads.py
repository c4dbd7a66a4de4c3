"""Gradients leave the device under optimizer offload (issue 27 item 6): every bucket is reduced in every
backward and its result streams to the host, where the microbatches are added (offload/host_grads.py).

Through the real Trainer: the device gradient buffers during backward are only the buckets in flight (no
shard, no full buffer: the old code kept the full fp32 buffer, or ZeRO-2's shard, on the device), and the
run equals world size 1 (loss, grad_norm, master weights) with several microbatches at dp > 1; the
bit-for-bit comparisons with the run without offload are in test_offload.py / test_offload_overlap.py.
"""
from __future__ import annotations

import pytest

from test_zero_accumulation import check, run

CPU = ["parallel.offload_optimizer=cpu"]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_offloaded_device_gradients_are_the_buckets_in_flight(worlds, zero):
    layout = [f"parallel.zero={zero}", "train.global_batch_size=8", *CPU]   # dp 2, 4 microbatches
    for r in worlds.run(2, run, layout, 2, True):
        assert r["microbatches"] == 4 and r["full"] > 2 * r["largest"]
        assert 0 < r["peak"] <= 2 * r["largest"], (r["peak"], r["full"], r["largest"])


@pytest.mark.parametrize("zero", [1, 2])
def test_offloaded_accumulation_matches_world_size_1(worlds, zero):
    layout = [f"parallel.zero={zero}", "train.global_batch_size=8", *CPU]
    ref = run(None, ["train.global_batch_size=8"], 3)
    check(worlds.run(2, run, layout, 3), ref, "fp32")


def test_offloaded_world_size_1_equals_plain_bit_for_bit():
    """World size 1 (one GPU), 4 microbatches: the host adds the microbatches in the order the device
    buffer would, so the offloaded run is the plain one to the bit."""
    plain = run(None, ["train.global_batch_size=4"], 3)
    off = run(None, ["train.global_batch_size=4", *CPU], 3)
    assert [r["loss"] for r in off["records"]] == [r["loss"] for r in plain["records"]]
    assert [r["grad_norm"] for r in off["records"]] == [r["grad_norm"] for r in plain["records"]]
    for name, (t, _, _) in plain["masters"].items():
        assert off["masters"][name][0].equal(t), name
