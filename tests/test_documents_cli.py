"""Packed documents and mixtures from the command line, in one pretrain + one evaluate run:
prepare_data (glob inputs, EOS sidecar) for two sources -> pretrain.py on their weighted mixture with
data.document_masking=true (EOS id from the sidecar) -> evaluate.py on each source's held-out file with
data.document_masking=true data.eos_id=0. Each source's loss must equal evaluating every document of its
evaluated windows alone with the saved weights; the overall loss is their token-weighted mean."""
from __future__ import annotations

import json

import numpy as np
import torch

from doc_helpers import per_document_loss_sum
from launch import prepare_data
from parallel3d.models.llama import Llama
from parallel3d.checkpoint.load import resolve_checkpoint_dir
from parity import load_imported
from test_launch import SMALL, _run


def _write_docs(path, words, n, seed):
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(1, 12))))}) + "\n")


def test_pretrain_mixture_with_masking_and_evaluate_per_source(tmp_path):
    sources = {"code": ["def", "return", "self", "x", "lambda"], "prose": ["alpha", "beta", "ring", "tensor"]}
    files = {}
    for i, (name, words) in enumerate(sources.items()):
        for shard in range(2):
            _write_docs(tmp_path / f"{name}{shard}.jsonl", words, 60, 10 * i + shard)
        files[name], files[name + "_eval"] = tmp_path / f"{name}.npy", tmp_path / f"{name}_eval.npy"
        assert prepare_data.main(["--input", str(tmp_path / f"{name}*.jsonl"), "--out", str(files[name]),
                                  "--eval-fraction", "0.3", "--eval-out", str(files[name + "_eval"])]) == 0
    meta = json.loads((tmp_path / "code.meta.json").read_text())
    assert meta["eos_id"] == 0 and meta["tokenizer"] == "bytes" and meta["num_tokens"] == len(np.load(files["code"]))
    assert (tmp_path / "prose_eval.meta.json").is_file()

    ckpt, small = tmp_path / "ckpt", [*SMALL, "parallel.tp=1", "train.steps=2"]
    _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", *small, "data.document_masking=true",
          f"data.paths=[[0.7, {files['code']}], [0.3, {files['prose']}]]", f"checkpoint.save_dir={ckpt}"])
    held = [str(files["code_eval"]), str(files["prose_eval"])]
    out = _run(["launch/evaluate.py", "--config", "configs/tiny.yaml", *small, f"checkpoint.load_dir={ckpt}",
                f"data.paths={held[0]}:1,{held[1]}:1", "data.document_masking=true", "data.eos_id=0"])
    lines = out.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert set(result["sources"]) == set(held) and any(line.startswith(f"source {held[0]}: loss") for line in lines)

    model = load_imported(resolve_checkpoint_dir(str(ckpt)), Llama)
    seq, gbs, totals = 32, 4, []
    for path in held:
        data = np.load(path).astype(np.int64)
        n = (len(data) - 1) // seq // gbs * gbs  # evaluate.py: whole global batches, samples in order
        windows = torch.tensor(np.stack([data[i * seq:i * seq + seq + 1] for i in range(n)]))
        total, count = per_document_loss_sum(model, windows, 0)
        got = result["sources"][path]
        assert got["tokens"] == count
        assert abs(got["loss"] - total / count) <= 1e-5 * total / count, (path, got, total / count)
        totals.append((total, count))
    assert result["tokens"] == sum(c for _, c in totals)
    assert abs(result["loss"] - sum(t for t, _ in totals) / result["tokens"]) <= 1e-5 * result["loss"]
