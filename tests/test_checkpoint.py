"""Distributed checkpoints across layouts (4 gloo ranks): save under one layout, resume under another.

Numerics are layout-independent (docs/architecture.md section 2.2), so one world-size-1 run is the reference for every layout:
steps after a resharded resume must match it within 1e-4 (losses and logged grad norms), and a same-layout
resume must repeat the uninterrupted run bit for bit.
"""
from __future__ import annotations

import math

import pytest

from ckpt_helpers import MOE, train, train_managed
from parallel3d.checkpoint import CheckpointReader
from parity import assert_grad_norms

STEPS, SAVE_AT = 6, 3

# (model overrides, layout saved under, layouts resumed under)
CASES = {
    "tp2pp2->dp4,tp4": ([], ["parallel.tp=2", "parallel.pp=2"], [["parallel.tp=1"], ["parallel.tp=4"]]),
    "tp2zero1->tp2zero0,zero3": ([], ["parallel.tp=2", "parallel.zero=1"], [["parallel.tp=2"], ["parallel.zero=3"]]),
    "zero3->tp2pp2zero1": ([], ["parallel.zero=3"], [["parallel.tp=2", "parallel.pp=2", "parallel.zero=1"]]),
    "tied-tp2pp2->zero3": (["model.tie_embeddings=true"], ["parallel.tp=2", "parallel.pp=2"],
                           [["parallel.zero=3"], ["parallel.pp=2", "parallel.zero=2"]]),
    # experts folded over TP x DP (whole experts on 4 EP ranks) -> EP over DP only, and experts split over etp=tp
    "moe-tp2sp-etp1ep4->ep2zero1,tp2etp2ep2": (MOE, ["parallel.tp=2", "parallel.sp=true", "parallel.ep=4"],
                                               [["parallel.ep=2", "parallel.zero=1"],
                                                ["parallel.tp=2", "parallel.etp=2", "parallel.ep=2"]]),
    "interleaved-pp2v2->cp2": (["model.num_layers=4", "train.global_batch_size=8"],
                               ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2"],
                               [["parallel.cp=2"]]),
}


def _assert_close(got, ref, rtol, what):
    assert len(got) == len(ref), what
    for i, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= rtol * abs(b), f"{what}: step {i}: {a} vs {b} (all: {got} vs {ref})"


def _assert_tiled(directory: str) -> None:
    """Every tensor's shards tile its global shape exactly once (dedup: no replica written twice)."""
    meta = CheckpointReader(directory).meta
    for name, entry in meta["tensors"].items():
        total = sum(math.prod(b - a for a, b in shard["slices"]) for shard in entry["shards"])
        assert total == math.prod(entry["global_shape"]), f"{name}: shards hold {total} elements"


@pytest.mark.parametrize("case", list(CASES))
def test_resume_under_other_layouts(worlds, tmp_path, case):
    """Losses and logged grad norms (tests/parity.py: clipping and Adam hide a uniform gradient scale from
    the losses) of the saving run and of every resumed run equal world size 1's uninterrupted run."""
    model, saved_layout, load_layouts = CASES[case]
    ref, ref_norms = train(None, model, STEPS, norms=True)  # world size 1, uninterrupted
    root = str(tmp_path / "ckpt")
    full, full_norms = worlds.run(4, train, model + saved_layout, STEPS, root, (SAVE_AT,), norms=True)[0]
    _assert_close(full, ref, 1e-5, f"{case}: saving run vs world size 1")
    assert_grad_norms([full_norms], ref_norms, what=f"{case}: saving run")
    _assert_tiled(f"{root}/step_{SAVE_AT:08d}")
    resumed = worlds.run(4, train, model + saved_layout, STEPS, None, (), root, norms=True)[0]
    assert resumed == (full[SAVE_AT:], full_norms[SAVE_AT:]), f"{case}: same-layout resume is not exact"
    for layout in load_layouts:
        got, got_norms = worlds.run(4, train, model + layout, STEPS, None, (), root, norms=True)[0]
        _assert_close(got, ref[SAVE_AT:], 1e-4, f"{case}: resumed under {layout}")
        assert_grad_norms([got_norms], ref_norms[SAVE_AT:], what=f"{case}: resumed under {layout}")
    single, single_norms = train(None, model, STEPS, load=root, norms=True)
    _assert_close(single, ref[SAVE_AT:], 1e-4, f"{case}: resumed at world size 1")
    assert_grad_norms([single_norms], ref_norms[SAVE_AT:], what=f"{case}: resumed at world size 1")


def _load_expecting_error(worker, overrides, root):
    from ckpt_helpers import build_trainer, context_for, make_config
    from parallel3d.checkpoint import CheckpointError, load_checkpoint

    cfg = make_config(overrides, worker.world_size)
    trainer = build_trainer(cfg, context_for(cfg, worker))
    try:
        load_checkpoint(trainer, root)
    except CheckpointError as e:
        return str(e)
    return None


def test_shard_missing_on_some_ranks_fails_everywhere(worlds, tmp_path):
    """Only the tp-rank-1 ranks read model-r00001; every rank must still raise (none left hanging)."""
    root = tmp_path / "ckpt"
    worlds.run(4, train, ["parallel.tp=2"], 1, str(root), (1,))
    victim = root / "step_00000001" / "model-r00001.safetensors"
    victim.unlink()
    messages = worlds.run(4, _load_expecting_error, ["parallel.tp=2"], str(root))
    assert all(m and str(victim) in m and "missing" in m for m in messages), messages


def test_async_saves_through_the_manager(worlds, tmp_path):
    """Background writes, committed by all ranks together; pruned to `keep`; resume is exact."""
    root = tmp_path / "ckpt"
    layout = ["parallel.tp=2", "parallel.zero=1"]
    full = worlds.run(4, train_managed, layout + [f"checkpoint.save_dir={root}", "checkpoint.async_save=true",
                                                  "checkpoint.interval=1", "checkpoint.keep=2"], STEPS)[0]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000005", "step_00000006"]
    _assert_tiled(str(root / "step_00000005"))
    resumed = worlds.run(4, train_managed, layout + [f"checkpoint.load_dir={root / 'step_00000005'}"], STEPS)[0]
    assert resumed == full[5:]
