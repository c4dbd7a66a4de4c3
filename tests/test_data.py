"""Token files, the layout-independent sampler, resumption, and launch/prepare_data.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from launch import prepare_data
from parallel3d.training.data import BatchSampler, DataError, TokenDataset, smallest_token_dtype, synthetic_tokens
from parallel3d.training.text import ByteTokenizer, tokenize_text_files

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(1000, dtype=np.uint16))
    return str(path)


def rows(t: torch.Tensor) -> list[tuple]:
    return sorted(tuple(r.tolist()) for r in t)


def test_samples_are_windows(token_file):
    ds = TokenDataset(token_file, seq_len=16)
    assert len(ds) == (1000 - 1) // 16
    assert ds[2].tolist() == list(range(32, 49)) and ds[2].dtype == torch.long


@pytest.mark.parametrize("dtype", ["uint16", "uint32", "int32", "int64"])
def test_token_dtypes(tmp_path, dtype):
    p = tmp_path / "t.npy"
    np.save(p, np.arange(50, dtype=dtype))
    assert TokenDataset(str(p), 8)[0].tolist() == list(range(9))


@pytest.mark.parametrize("dp", [1, 2, 4])
@pytest.mark.parametrize("micro", [1, 2])
def test_global_batch_identical_across_layouts(token_file, dp, micro):
    ds = TokenDataset(token_file, seq_len=16)
    B = 8
    ref = BatchSampler(ds, B, seed=7)
    sampler = BatchSampler(ds, B, seed=7)
    nmb = B // (dp * micro)
    for step in (0, 1, 5, 13):               # 13 * 8 > 62 samples: crosses an epoch boundary
        local = [mb for r in range(dp) for mb in sampler.local_batch(step, r, dp, nmb, micro)]
        assert len(local) == dp * nmb and all(mb.shape == (micro, 17) for mb in local)
        assert rows(torch.cat(local)) == rows(ref.global_batch(step))
        # documented order: rank blocks are contiguous, microbatches split them in order
        assert torch.equal(torch.cat(local), ref.global_batch(step))


def test_epochs_cover_every_sample_once(token_file):
    ds = TokenDataset(token_file, seq_len=10)            # 99 samples
    s = BatchSampler(ds, 9, seed=3)
    seen = np.concatenate([s.indices(k) for k in range(11)])
    assert sorted(seen.tolist()) == list(range(99))
    second = np.concatenate([s.indices(k) for k in range(11, 22)])   # epoch 1: every sample once more,
    assert sorted(second.tolist()) == list(range(99))                # in an order of its own
    assert not np.array_equal(seen, second)
    assert not np.array_equal(s.indices(0), BatchSampler(ds, 9, seed=4).indices(0))
    assert BatchSampler(ds, 9, seed=3, shuffle=False).indices(1).tolist() == list(range(9, 18))


def test_resume_state_checks_the_stream(token_file):
    """Batches are a function of the step (no cursor); the saved state names the position and refuses a
    resume that would silently change the stream."""
    ds = TokenDataset(token_file, seq_len=16)
    a, b = BatchSampler(ds, 4, seed=11), BatchSampler(ds, 4, seed=11)
    for k in (0, 7, 19):
        assert all(torch.equal(x, y) for x, y in zip(a.local_batch(k, 0, 2, 1, 2), b.local_batch(k, 0, 2, 1, 2)))
    state = json.loads(json.dumps(a.state_dict(7)))
    assert state["step"] == 7 and state["position"] == 28 and state["seed"] == 11 and "epoch" in state
    b.check_resume(state)
    with pytest.raises(DataError, match="saved seed=11, current seed=12"):
        BatchSampler(ds, 4, seed=12).check_resume(state)
    with pytest.raises(DataError, match="global_batch_size"):
        BatchSampler(ds, 8, seed=11).check_resume(state)


def test_local_batch_shape_mismatch(token_file):
    s = BatchSampler(TokenDataset(token_file, 16), 8, seed=0)
    with pytest.raises(DataError, match="!= global_batch_size 8"):
        s.local_batch(0, 0, 2, 3, 1)


def test_file_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        TokenDataset(str(tmp_path / "nope.npy"), 8)
    short = tmp_path / "short.npy"
    np.save(short, np.arange(5, dtype=np.int32))
    with pytest.raises(DataError, match=r"short.npy.*holds 5 tokens, fewer than seq_len \+ 1 = 9"):
        TokenDataset(str(short), 8)
    twod = tmp_path / "twod.npy"
    np.save(twod, np.zeros((4, 4), dtype=np.int32))
    with pytest.raises(DataError, match=r"twod.npy.*must be a 1-D array.*\(4, 4\)"):
        TokenDataset(str(twod), 2)
    flt = tmp_path / "flt.npy"
    np.save(flt, np.zeros(40, dtype=np.float32))
    with pytest.raises(DataError, match="dtype float32"):
        TokenDataset(str(flt), 2)
    junk = tmp_path / "junk.npy"
    junk.write_bytes(b"not numpy")
    with pytest.raises(DataError, match="not a readable .npy"):
        TokenDataset(str(junk), 2)
    big = tmp_path / "big.npy"
    np.save(big, np.array([1, 2, 300, 4], dtype=np.uint16))
    with pytest.raises(DataError, match=r"id 300 outside the vocabulary \[0, 256\)"):
        TokenDataset(str(big), 2, vocab_size=256)


def test_tokenizer_and_synthetic():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.eos_id) == (256, 0)
    assert tok.decode(tok.encode("héllo")) == "héllo"
    tok2 = ByteTokenizer(["<eos>", "<pad>"])
    assert (tok2.vocab_size, tok2.eos_id) == (258, 256)
    assert smallest_token_dtype(256) == np.uint16 and smallest_token_dtype(128256) == np.uint32
    a = synthetic_tokens(5000, 256, seed=1)
    assert len(a) == 5000 and a.max() < 128 and np.array_equal(a, synthetic_tokens(5000, 256, seed=1))
    assert TokenDataset.from_array(a, 64, name="<synthetic>")[0].shape == (65,)


@pytest.mark.parametrize("num_tokens,vocab_size,seed", [(1, 256, 0), (5000, 256, 1), (123_457, 100, 3),
                                                        (400_000, 128_256, 7)])
def test_synthetic_tokens_drawn_at_once_are_the_sentence_loops(num_tokens, vocab_size, seed):
    """The demo data is the same bits whichever way its words are drawn (so `make demo` prints the same
    losses), and where a draw of the loop would be redrawn, the bulk draw gives way to the loop."""
    from parallel3d.training import data

    loop = data._sentences_one_by_one(np.random.default_rng(seed), num_tokens)
    assert np.array_equal(synthetic_tokens(num_tokens, vocab_size, seed), (loop.astype(np.int64) % vocab_size))

    class Words:   # a generator whose 32-bit words are `words`: rng.integers(6) redraws u = 0 (0 * 6 mod 2^32 < 4)
        def __init__(self, words):
            self.words = words

        def integers(self, low, high, size, dtype):
            return self.words.reshape(size).astype(dtype)

    words = np.random.default_rng(0).integers(1, 2 ** 31, size=(100, 3))
    assert data._sentences_at_once(Words(words), 50, 100) is not None
    words[-1, 0] = 0                    # a redraw past the sentences the 50 tokens need changes nothing
    assert data._sentences_at_once(Words(words), 50, 100) is not None
    words[0, 0] = 0
    assert data._sentences_at_once(Words(words), 50, 100) is None


def test_prepare_data_text_and_jsonl(tmp_path, capsys):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world")
    jl = tmp_path / "b.jsonl"
    jl.write_text(json.dumps({"text": "doc one"}) + "\n\n" + json.dumps({"text": "doc two", "id": 2}) + "\n")
    out = tmp_path / "tok.npy"
    assert prepare_data.main(["--input", str(txt), str(jl), "--out", str(out)]) == 0
    tokens = np.load(out)
    assert tokens.dtype == np.uint16
    expected = tokenize_text_files([str(txt), str(jl)], ByteTokenizer())
    assert np.array_equal(tokens, expected)
    docs = ByteTokenizer().decode(tokens)            # eos (byte 0) is dropped by decode
    assert docs == "hello worlddoc onedoc two"
    assert np.flatnonzero(tokens == 0).tolist() == [11, 19, 27] and len(tokens) == 28   # eos after each doc

    train, ev = tmp_path / "train.npy", tmp_path / "eval.npy"
    assert prepare_data.main(["--input", str(jl), "--out", str(train), "--eval-fraction", "0.3",
                              "--eval-out", str(ev)]) == 0
    t, e = np.load(train), np.load(ev)
    assert np.array_equal(np.concatenate([t, e]), tokenize_text_files([str(jl)], ByteTokenizer()))
    assert t[-1] == 0 and ByteTokenizer().decode(e) == "doc two"      # cut at a document boundary


def test_prepare_data_errors_and_script(tmp_path):
    missing = str(tmp_path / "missing.txt")
    assert prepare_data.main(["--input", missing, "--out", str(tmp_path / "o.npy")]) == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    assert prepare_data.main(["--input", str(bad), "--out", str(tmp_path / "o.npy")]) == 1
    proc = subprocess.run([sys.executable, "launch/prepare_data.py", "--input", missing, "--out", "x.npy"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "missing.txt" in proc.stderr and "does not exist" in proc.stderr


def test_prepare_data_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    tok = tokenizers.Tokenizer(WordLevel({"hello": 0, "world": 1, "</s>": 2, "[UNK]": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok_path = str(tmp_path / "tokenizer.json")
    tok.save(tok_path)
    txt = tmp_path / "a.txt"
    txt.write_text("hello world hello")
    out = tmp_path / "t.npy"
    assert prepare_data.main(["--input", str(txt), "--out", str(out), "--tokenizer", tok_path]) == 0
    assert np.load(out).tolist() == [0, 1, 0, 2]
