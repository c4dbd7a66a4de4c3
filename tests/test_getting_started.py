"""docs/getting-started.md, run as written: its code blocks in order, in a scratch directory, at a tiny model
size (the only substitutions: torchrun -> this interpreter's torch.distributed.run, and size overrides
appended to the pretrain / evaluate commands). Then the exported directory is checked from transformers:
its tokenizer is the one the data was prepared with, and it generates."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "getting-started.md"
SIZE = ["model.hidden_size=32", "model.ffn_hidden_size=64", "train.seq_len=32"]
TRAIN = ["train.steps=4", "train.eval_interval=2", "train.eval_steps=1", "log.interval=1"]

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


def guide_blocks() -> list[tuple[str, str]]:
    """(language, code) of every bash/python block, in order; the install block is left out."""
    blocks = re.findall(r"```(bash|python)\n(.*?)```", GUIDE.read_text(), re.S)
    return [(lang, code) for lang, code in blocks if "pip install" not in code]


def tiny(code: str) -> str:
    """The guide's shell code with torchrun spelled as this interpreter and the size overrides appended."""
    code = code.replace("\\\n", " ").replace("torchrun", f"{sys.executable} -m torch.distributed.run")
    lines = []
    for line in code.splitlines():
        if "launch/pretrain.py" in line:
            line += " " + " ".join(SIZE + TRAIN)
        elif "launch/evaluate.py" in line:
            line += " " + " ".join(SIZE)
        lines.append(line)
    return "\n".join(lines)


def test_guide_journey_text_to_transformers_generate(tmp_path):
    for name in ("launch", "configs"):
        (tmp_path / name).symlink_to(ROOT / name)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    env.pop("TRITON_INTERPRET", None)
    blocks = guide_blocks()
    assert [lang for lang, _ in blocks] == ["python", "python", "bash", "bash", "bash", "bash", "python"]
    outputs = []
    for lang, code in blocks:
        cmd = ["bash", "-euo", "pipefail", "-c", tiny(code)] if lang == "bash" else [sys.executable, "-c", code]
        out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, f"{code}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        outputs.append(out.stdout)
    _, _, prepare, pretrain, evaluate, export, generate = outputs

    # pretrain: progress lines with the eval loss, one summary from four ranks
    assert len(re.findall(r"^done: 4 steps .* \| eval loss [\d.]+ \|", pretrain, re.M)) == 1, pretrain
    assert len(re.findall(r"^step +\d+ \|.*\| eval loss [\d.]+$", pretrain, re.M)) == 2, pretrain
    # evaluate: the last line is the loss on the held-out tokens
    result = json.loads(evaluate.strip().splitlines()[-1])
    assert 0 < result["loss"] < 10 and result["tokens"] > 0
    assert "tokenizer: " in export

    # the exported tokenizer is the one the data was prepared with: the first document's ids match
    from transformers import AutoConfig, AutoTokenizer

    run = tmp_path / "runs"
    meta = json.loads((run / "data" / "train.meta.json").read_text())
    tokens = np.load(run / "data" / "train.npy")
    first_doc = sorted((run / "corpus").glob("*.txt"))[0].read_text()
    tokenizer = AutoTokenizer.from_pretrained(run / "hf_model")
    ids = tokenizer(first_doc, add_special_tokens=False).input_ids
    assert ids == tokens[:len(ids)].tolist() and tokens[len(ids)] == meta["eos_id"]
    assert tokenizer.eos_token_id == meta["eos_id"] == AutoConfig.from_pretrained(run / "hf_model").eos_token_id
    assert len(tokenizer) == meta["vocab_size"]
    # generate: the prompt, then new text
    assert generate.startswith("Return a new") and len(generate.strip()) > len("Return a new"), generate

    # --tokenizer names another source (here a Hugging Face tokenizer directory); it takes precedence
    other = tmp_path / "other_tokenizer"
    other.mkdir()
    AutoTokenizer.from_pretrained(run / "hf_model").save_pretrained(other)
    out = subprocess.run([sys.executable, "launch/convert_hf.py", "export", "--ckpt", "runs/ckpt", "--out", "again",
                          "--tokenizer", str(other)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0 and f"tokenizer: {other}" in out.stdout, out.stdout + out.stderr
    assert AutoTokenizer.from_pretrained(tmp_path / "again")(first_doc).input_ids[:len(ids)] == ids
