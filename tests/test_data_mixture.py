"""Weighted mixtures of token files (data.paths): parsing, the (seed, step) sampler, resume, the sidecar's
EOS id. The command line (pretrain on a mixture, evaluate.py per source) is tests/test_documents_cli.py."""
from __future__ import annotations

import numpy as np
import pytest

from ckpt_helpers import rel_close, train
from parallel3d.training.config import ConfigError
from parallel3d.training.data import DataError
from parallel3d.training.data_sources import MixtureDataset, MixtureSampler, parse_mixture, write_metadata

SEQ = 8


@pytest.fixture
def two_files(tmp_path):
    """a.npy holds ids 1..99 only, b.npy ids 100..199: every sample tells its source."""
    rng = np.random.default_rng(0)
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    np.save(a, rng.integers(1, 100, 40 * SEQ + 1).astype(np.uint16))
    np.save(b, rng.integers(100, 200, 25 * SEQ + 1).astype(np.uint16))
    return str(a), str(b)


def test_parse_both_forms_and_errors():
    assert parse_mixture("a.npy:0.7,b.npy:0.3") == [(0.7, "a.npy"), (0.3, "b.npy")]
    assert parse_mixture([[3, "a.npy"], [1, "b.npy"]]) == [(0.75, "a.npy"), (0.25, "b.npy")]
    for bad, msg in [("a.npy", "PATH:WEIGHT"), ("a.npy:x", "not a number"), ("a.npy:0", "> 0"),
                     ([[0.5, "a.npy"], [0.5, "a.npy"]], "twice"), (5, "must be a list")]:
        with pytest.raises(DataError, match=msg):
            parse_mixture(bad)


def test_sampler_weights_determinism_and_layouts(two_files):
    a, b = two_files
    ds = MixtureDataset.from_spec(f"{a}:0.7,{b}:0.3", SEQ, vocab_size=256)
    sampler = MixtureSampler(ds, 8, seed=5)
    batches = [sampler.global_batch(s) for s in range(60)]
    share_a = np.mean([float((x[:, 0] < 100).float().mean()) for x in batches])
    assert abs(share_a - 0.7) < 0.05, share_a  # 480 draws: 3 standard deviations ~ 0.06
    again = MixtureSampler(MixtureDataset.from_spec(f"{a}:0.7,{b}:0.3", SEQ), 8, seed=5)
    assert all((again.global_batch(s) == batches[s]).all() for s in (0, 17, 59))  # (seed, step) only
    for dp, micro in [(2, 2), (4, 1)]:  # every layout reads the same global batch
        rows = [mb for r in range(dp) for mb in sampler.local_batch(7, r, dp, 8 // (dp * micro), micro)]
        assert (np.concatenate(rows) == batches[7].numpy()).all()
    state = sampler.state_dict(3)
    MixtureSampler(MixtureDataset.from_spec(f"{a}:0.7,{b}:0.3", SEQ), 8, seed=5).check_resume(state)
    with pytest.raises(DataError, match="weights"):
        MixtureSampler(MixtureDataset.from_spec(f"{a}:0.5,{b}:0.5", SEQ), 8, seed=5).check_resume(state)


def test_mixture_training_resumes_exactly(tmp_path, two_files):
    a, b = two_files
    mix = [f"data.paths={a}:0.6,{b}:0.4", "train.seq_len=8", "model.vocab_size=256", "train.steps=4"]
    full = train(None, mix, 4)
    train(None, mix, 2, save_root=str(tmp_path / "ck"), save_at=[2])
    resumed = train(None, mix, 4, load=str(tmp_path / "ck"))
    assert rel_close(resumed, full[2:], 1e-6), (resumed, full)


def test_eos_id_from_the_sidecar(two_files):
    from ckpt_helpers import make_config
    a, b = two_files
    write_metadata(a, 7, "bytes", 256, np.load(a))
    cfg = make_config([f"data.path={a}", "data.document_masking=true"], 1)
    assert cfg.data.eos_id == 7 and cfg.data.reset_positions
    write_metadata(b, 9, "other", 256, np.load(b))
    with pytest.raises(ConfigError, match="disagree"):
        make_config([f"data.paths={a}:1,{b}:1", "data.document_masking=true"], 1)
    assert make_config([f"data.paths={a}:1,{b}:1", "data.document_masking=true", "data.eos_id=9"], 1).data.eos_id == 9
    with pytest.raises(ConfigError, match="not both"):
        make_config([f"data.path={a}", f"data.paths={a}:1,{b}:1"], 1)
