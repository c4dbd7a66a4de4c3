"""train.activation_offload through the real Trainer: saved activations really leave for host memory and
come back, and the run is identical to the run without offload (copies preserve values exactly)."""
from __future__ import annotations

import pytest
import torch

from test_trainer_regressions import run


BIGGER = ["train.seq_len=128", "model.hidden_size=64", "model.ffn_hidden_size=128"]  # activations > min_bytes


def _pair(worker, layout):
    layout = [*BIGGER, *layout]
    plain = run(worker, layout, 2)
    offloaded = run(worker, [*layout, "train.activation_offload=true"], 2)
    return plain, offloaded


@pytest.mark.parametrize("layout", [
    ["parallel.tp=2", "parallel.pp=2", "parallel.sp=true", "train.activation_checkpointing=selective"],
    ["parallel.pp=2", "parallel.tp=1", "parallel.zero=1", "train.activation_checkpointing=full",
     "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32"],
], ids=["tp-pp-sp-selective", "pp-dp-zero1-full-moe"])
def test_offload_is_exact_and_moves_activations(worlds, layout):
    for plain, offloaded in worlds.run(4, _pair, layout):
        assert [r["loss"] for r in offloaded["records"]] == [r["loss"] for r in plain["records"]]
        for name, (t, _, _) in plain["weights"].items():
            assert torch.equal(offloaded["weights"][name][0], t), name
        assert all(r["activation_offload_bytes"] > 0 for r in offloaded["records"])
        assert all(r["activation_offload_bytes"] == 0 for r in plain["records"])
