"""ZB-V and DualPipe-V from the command line (launch/pretrain.py under torchrun): per-step losses equal the
world-size-1 run's (rel 1e-5), and log.timeline draws the V schedule's measured step."""
from __future__ import annotations

import json

import pytest

from test_launch import SMALL, _losses, _run, assert_log_parity

BATCH = [*SMALL, "train.global_batch_size=8", "model.tie_embeddings=true"]  # >= 2*pp microbatches per dp rank


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    log = tmp_path_factory.mktemp("ws1") / "m.jsonl"
    _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", *BATCH, f"log.jsonl={log}"])
    return log


@pytest.mark.parametrize("layout", [   # make sweep runs DualPipe-V here too (test_pipeline_vshape_trainer runs it in CI)
    ["parallel.tp=1", "parallel.pp=2", "parallel.schedule=zb-v"],
    pytest.param(["parallel.tp=1", "parallel.dp=2", "parallel.pp=2", "parallel.schedule=dualpipe-v",
                  "parallel.zero=1"], marks=pytest.mark.sweep),
], ids=["zb-v", "dualpipe-v-dp2-zero1"])
def test_v_schedules_from_the_command_line(tmp_path, reference, layout):
    from parallel3d.pipeline import build_schedule

    log, timeline = tmp_path / "m.jsonl", tmp_path / "t.json"
    out = _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", *BATCH, *layout, f"log.jsonl={log}",
                f"log.timeline={timeline}"], nproc=2 if "parallel.dp=2" not in layout else 4)
    assert len(_losses(log)) == 3
    assert_log_parity(log, reference)
    name = layout[-1 if "zero" not in layout[-1] else -2].split("=")[1]
    assert f"({name}, pp=2): measured bubble" in out.stdout
    measured = json.loads(timeline.read_text())["measured"]
    schedule = build_schedule(name, 2, 8 // (2 if "parallel.dp=2" in layout else 1), 2)
    for rank in range(2):  # the measured step ran the V schedule's compute actions, in order
        want = [(a.kind.name, a.microbatch, a.chunk) for a in schedule[rank] if a.kind.is_compute]
        compute = ("FORWARD", "BACKWARD", "BACKWARD_INPUT", "BACKWARD_WEIGHT")
        got = [(k, mb, c) for r, k, mb, c, *_ in measured if r == rank and k in compute]
        assert got == want
