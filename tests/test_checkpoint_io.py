"""Checkpoint files, atomic commit, pruning, async save, damaged checkpoints, weights-only and HF export
(world size 1, in process: fast)."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ckpt_helpers import build_trainer, context_for, make_config, train
from parallel3d.checkpoint import CheckpointError, CheckpointReader, load_checkpoint, save_checkpoint
from parallel3d.checkpoint import save as save_mod
from parallel3d.checkpoint.manager import CheckpointManager

STEP2 = "step_00000002"


def _trainer(*overrides):
    cfg = make_config(list(overrides), 1)
    return build_trainer(cfg, context_for(cfg))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A root with checkpoints at steps 1 and 2 of one run, plus that run's losses of steps 3..4."""
    root = str(tmp_path_factory.mktemp("ckpt") / "root")
    losses = train(None, [], 4, root, (1, 2))
    return root, losses[2:]


def _copy(saved, tmp_path) -> str:
    dst = str(tmp_path / "root")
    shutil.copytree(saved[0], dst)
    return dst


def test_layout_on_disk(saved):
    root, _ = saved
    assert open(os.path.join(root, "latest")).read().strip() == STEP2
    step = os.path.join(root, STEP2)
    files = sorted(os.listdir(step))
    assert files == ["config.yaml", "metadata.json", "model-r00000.safetensors", "optim-r00000.safetensors",
                     "rng-r00000.json"]
    meta = json.load(open(os.path.join(step, "metadata.json")))
    assert meta["step"] == 2 and meta["weights_only"] is False and meta["format"] == "parallel3d/1"
    assert meta["layout"]["tp"] == 1 and meta["layout"]["world_size"] == 1 and meta["layout"]["zero"] == 0
    assert meta["model"]["hidden_size"] == 32 and meta["data"]["step"] == 2 and meta["optimizer"]["step"] == 2
    assert meta["rng_files"] == {"0": "rng-r00000.json"}
    names = set(meta["tensors"])
    assert "embed.weight" in names and "optim.master.embed.weight" in names
    assert {"optim.exp_avg.norm.weight", "optim.exp_avg_sq.norm.weight"} <= names
    for name, entry in meta["tensors"].items():
        assert entry["shards"][0]["file"].startswith("optim-" if name.startswith("optim.") else "model-")


def test_exact_resume_from_root_and_step_dir(saved):
    root, later = saved
    assert train(None, [], 4, load=root) == later
    assert train(None, [], 4, load=os.path.join(root, STEP2)) == later


def test_keep_prunes_old_checkpoints(tmp_path):
    root = str(tmp_path / "root")
    train(None, [], 4, root, (1, 2, 3, 4), keep=2)
    assert sorted(os.listdir(root)) == ["latest", "step_00000003", "step_00000004"]


def test_interrupted_save_leaves_previous_checkpoint(saved, tmp_path, monkeypatch):
    root = _copy(saved, tmp_path)
    trainer = _trainer()
    trainer.step = 5
    real = save_mod.write_shard_file

    def dies_on_optimizer(directory, name, tensors):  # the "process" dies after the model shard
        if name.startswith("optim"):
            raise OSError("simulated crash while writing")
        return real(directory, name, tensors)

    monkeypatch.setattr(save_mod, "write_shard_file", dies_on_optimizer)
    with pytest.raises(CheckpointError, match="simulated crash"):
        save_checkpoint(trainer, root)
    assert open(os.path.join(root, "latest")).read().strip() == STEP2
    assert os.path.isdir(os.path.join(root, "step_00000005.tmp"))
    assert train(None, [], 4, load=root) == saved[1]
    monkeypatch.setattr(save_mod, "write_shard_file", real)
    save_checkpoint(trainer, root)  # the next save clears the debris
    assert sorted(os.listdir(root)) == ["latest", "step_00000001", STEP2, "step_00000005"]


def test_killed_before_commit(saved, tmp_path):
    """A complete-looking .tmp directory (killed just before the rename) is never loaded."""
    root = _copy(saved, tmp_path)
    shutil.copytree(os.path.join(root, STEP2), os.path.join(root, "step_00000009.tmp"))
    assert load_checkpoint(_trainer(), root).path.endswith(STEP2)


def _damage(root, how):
    step = os.path.join(root, STEP2)
    target = os.path.join(step, "optim-r00000.safetensors")
    if how == "corrupt":
        with open(target, "r+b") as f:
            f.seek(os.path.getsize(target) - 100)
            f.write(b"\x7f" * 8)
        return target, "checksum"
    if how == "truncated":
        os.truncate(target, os.path.getsize(target) // 2)
        return target, "truncated"
    if how == "missing shard":
        os.remove(target)
        return target, "missing"
    if how == "metadata":
        meta = os.path.join(step, "metadata.json")
        os.truncate(meta, 100)
        return meta, "corrupt"
    if how == "latest":
        with open(os.path.join(root, "latest"), "w") as f:
            f.write("step_00000077\n")
        return os.path.join(root, "latest"), "not a complete checkpoint"
    raise ValueError(how)


@pytest.mark.parametrize("how", ["corrupt", "truncated", "missing shard", "metadata", "latest"])
def test_damaged_checkpoint_names_the_file(saved, tmp_path, how):
    root = _copy(saved, tmp_path)
    path, words = _damage(root, how)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(_trainer(), root)
    assert path in str(e.value) and words in str(e.value)


def test_other_model_shape_is_refused(saved):
    with pytest.raises(CheckpointError, match=r"another model shape.*hidden_size=32 \(config: 64\)"):
        load_checkpoint(_trainer("model.hidden_size=64"), saved[0])


def test_other_data_stream_is_refused(saved):
    with pytest.raises(CheckpointError, match="global_batch_size"):
        load_checkpoint(_trainer("train.global_batch_size=8"), saved[0])


FP16_WINDOW = ["train.precision=fp16", "train.initial_loss_scale=1024", "train.loss_scale_window=2"]


def _fp16_scales(steps: int, save_root=None, save_at=(), load=None) -> list[tuple[float, float]]:
    """(loss, loss scale after the step) of each step the run takes."""
    trainer = _trainer(*FP16_WINDOW)
    if load:
        load_checkpoint(trainer, load)
    out = []
    while trainer.step < steps:
        out.append((trainer.train_step()["loss"], trainer.optimizer.loss_scale))
        if trainer.step in save_at:
            save_checkpoint(trainer, save_root, keep=0)
    return out


def test_fp16_loss_scaler_resumes_mid_window(tmp_path):
    """A run saved one good step into a 2-step scale window doubles its scale one step after resuming, as
    the run that never stopped does (the scaler's good-step count is checkpoint state, not reset)."""
    root = str(tmp_path / "root")
    whole = _fp16_scales(5, root, save_at=(1,))
    assert [s for _, s in whole] == [1024, 2048, 2048, 4096, 4096]   # no overflow at this scale: doubles every 2
    assert _fp16_scales(5, load=root) == whole[1:]


def test_weights_only_checkpoint_starts_fresh(tmp_path):
    from parallel3d.checkpoint.store import write_metadata, write_shard_file
    from parallel3d.params import real_part

    source = _trainer()
    source.train_step()
    weights = {n: (real_part(p.detach(), p.meta), p.meta.global_shape, p.meta.slices)
               for n, p in source.chunks[0].named_parameters()}
    d = str(tmp_path / "import")
    os.makedirs(d)
    write_metadata(d, write_shard_file(d, "weights-00000.safetensors", weights), step=0, weights_only=True,
                   model={"hidden_size": 32}, layout=None)
    trainer = _trainer("parallel.zero=3")
    result = load_checkpoint(trainer, d)
    assert result.weights_only and result.step == 0 and trainer.step == 0
    state = trainer.optimizer.state_tensors()
    for name, (w, _, _) in weights.items():
        torch.testing.assert_close(state[f"master/{name}"][0], w, rtol=0, atol=0)
        assert not state[f"exp_avg/{name}"][0].any()


def test_async_save_matches_sync(tmp_path):
    roots = {}
    for mode in ("sync", "async"):
        trainer = _trainer(f"checkpoint.save_dir={tmp_path / mode}", f"checkpoint.async_save={mode == 'async'}",
                           "checkpoint.interval=1")
        manager = CheckpointManager(trainer, log=False)
        for _ in range(2):
            trainer.train_step()
            manager.after_step()
        manager.finish()
        roots[mode] = str(tmp_path / mode)
    assert sorted(os.listdir(roots["async"])) == ["latest", "step_00000001", STEP2]
    a, b = (CheckpointReader(os.path.join(roots[m], STEP2)) for m in ("sync", "async"))
    assert a.tensor_names == b.tensor_names
    for name in a.tensor_names:
        assert torch.equal(a.read(name), b.read(name)), name


def test_hf_export_of_training_checkpoint(saved, tmp_path):
    transformers = pytest.importorskip("transformers")
    from parallel3d.models.hf import export_hf

    export_hf(os.path.join(saved[0], STEP2), str(tmp_path / "hf"))
    model = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"))
    reader = CheckpointReader(os.path.join(saved[0], STEP2))
    assert torch.equal(model.model.embed_tokens.weight.detach(), reader.read("embed.weight"))
    assert len(model.state_dict()) == len([n for n in reader.tensor_names if not n.startswith("optim.")])


def test_model_only_load_for_evaluation(saved):
    from parallel3d.training.loop import load_weights_if_any

    trainer = _trainer("parallel.zero=3")
    load_weights_if_any(trainer, saved[0])
    reader = CheckpointReader(os.path.join(saved[0], STEP2))
    assert trainer.step == 0
    master = trainer.optimizer.state_tensors()
    for name in ("embed.weight", "layers.1.mlp.down_proj.weight"):
        assert torch.equal(master[f"master/{name}"][0], reader.read(name))
        assert not master[f"exp_avg/{name}"][0].any()


# ---------------------------------------------------------------------------------- the command line
CLI = ["model.hidden_size=32", "model.num_layers=2", "model.ffn_hidden_size=64", "model.kernels=torch",
       "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1", "train.warmup_steps=1",
       "train.steps=4", "parallel.tp=1", "log.interval=100"]


def _pretrain(*args):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)}
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", *CLI, *args],
                          cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_pretrain_resumes_and_reports_bad_checkpoints(tmp_path):
    root = tmp_path / "root"
    first = _pretrain(f"checkpoint.save_dir={root}", "checkpoint.interval=2", f"log.jsonl={tmp_path / 'a.jsonl'}")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = _pretrain(f"checkpoint.load_dir={root / STEP2}", f"log.jsonl={tmp_path / 'b.jsonl'}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    losses = [[json.loads(line)["loss"] for line in open(tmp_path / f"{n}.jsonl")] for n in "ab"]
    assert losses[1] == losses[0][2:]

    other = _pretrain("model.hidden_size=64", f"checkpoint.load_dir={root}")
    assert other.returncode == 2 and "another model shape" in other.stderr
    assert str(root / "step_00000004" / "metadata.json") in other.stderr
    shard = root / "step_00000004" / "optim-r00000.safetensors"
    os.truncate(shard, 1000)
    bad = _pretrain(f"checkpoint.load_dir={root}")
    assert bad.returncode == 2 and str(shard) in bad.stderr and "truncated" in bad.stderr, bad.stderr[-3000:]
    assert "Traceback" not in bad.stderr
