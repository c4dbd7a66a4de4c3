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


def _optimizer_pair(worker, layout):
    from test_sweep import run as run_with_masters  # fp32 master weights: held under every ZeRO stage

    return run_with_masters(worker, layout), run_with_masters(worker, [*layout, "parallel.offload_optimizer=cpu"])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_optimizer_offload_is_exact(worlds, zero):
    """parallel.offload_optimizer=cpu keeps master weights and Adam state in host memory and steps there;
    the run equals the one without offload (on this CPU machine the homes coincide, but the code path --
    separate device parameters, host AdamW on a copy of the held gradient, device all-gather -- is the one
    a GPU run takes)."""
    layout = ["parallel.tp=2", f"parallel.zero={zero}", "train.precision=bf16" if zero == 2 else "train.precision=fp32"]
    for plain, offloaded in worlds.run(4, _optimizer_pair, layout):
        assert offloaded["losses"] == plain["losses"]
        for name, (t, _, _) in plain["weights"].items():
            assert offloaded["weights"][name][0].device.type == "cpu"
            assert torch.equal(offloaded["weights"][name][0], t), name


def test_nvme_offload_without_a_directory_is_refused_clearly():
    from ckpt_helpers import make_config
    from parallel3d.training.config import ConfigError
    with pytest.raises(ConfigError, match="nvme needs parallel.offload_dir"):
        make_config(["parallel.offload_optimizer=nvme"], 1)


def _resume(worker, root):
    from ckpt_helpers import train

    layout = ["parallel.zero=1", "parallel.offload_optimizer=cpu"]
    full = train(worker, layout, 4)
    first = train(worker, layout, 2, save_root=root, save_at=[2])
    rest = train(worker, ["parallel.zero=2", "parallel.offload_optimizer=cpu"], 4, load=root)  # reshard too
    return full, first + rest


def test_offloaded_optimizer_state_checkpoints_and_resumes(worlds, tmp_path):
    for full, resumed in worlds.run(2, _resume, str(tmp_path / "ckpt")):
        assert resumed == pytest.approx(full, rel=1e-6)
