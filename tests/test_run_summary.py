"""What a person watches: the progress line (eval loss when computed, skipped steps when any), the summary
at the end of every run (rank 0 only), and `make demo`'s next commands, all through the command line."""
import json
import re
import shlex
import subprocess

import pytest

from test_launch import ROOT, SMALL, _run

SUMMARY = re.compile(r"^done: (\d+) steps \(step (\d+) to (\d+)\) \| loss ([\d.]+) -> ([\d.]+)"
                     r"(?: \| eval loss ([\d.]+))?(?: \| skipped (\d+))? \| ([\d,]+) tokens at ([\d,]+) tok/s"
                     r" \| wall ([\d.]+) s$", re.M)


def _summaries(text):
    return SUMMARY.findall(text)


def test_progress_line_shows_eval_loss_and_skipped_steps_and_run_ends_with_summary(tmp_path):
    log = tmp_path / "m.jsonl"
    # fp16 with a static loss scale of 1e30 overflows every step: each one is skipped (train.nan_policy=skip)
    out = _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", *SMALL, "train.steps=4",
                "train.eval_interval=2", "train.eval_steps=1", "log.interval=3", "train.precision=fp16",
                "train.loss_scale=1e30", f"log.jsonl={log}"])
    records = [json.loads(line) for line in open(log)]
    progress = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    # log.interval=3 prints step 3; steps 2 and 4 print because they computed an eval loss
    assert [int(line.split()[1]) for line in progress] == [2, 3, 4], out.stdout
    for line in progress:
        r = records[int(line.split()[1]) - 1]
        assert ("| eval loss" in line) == ("eval_loss" in r), line
        if "eval_loss" in r:
            assert f"| eval loss {r['eval_loss']:.4f}" in line, line
        assert line.endswith(f"| skipped {sum(x['skipped'] for x in records[:r['step']])}"), line
    assert all(r["skipped"] for r in records)
    (summary,) = _summaries(out.stdout)
    steps, first, last, loss0, loss1, eval_loss, skipped, tokens, _, wall = summary
    assert (int(steps), int(first), int(last)) == (4, 1, 4)
    assert (loss0, loss1) == (f"{records[0]['loss']:.4f}", f"{records[-1]['loss']:.4f}")
    assert eval_loss == f"{records[-1]['eval_loss']:.4f}" and int(skipped) == 4
    assert int(tokens.replace(",", "")) == sum(r["tokens"] for r in records) == 4 * 4 * 32
    assert float(wall) > 0


def test_a_clean_run_summary_has_no_skipped_or_eval_part():
    out = _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", *SMALL, "log.interval=5"])
    assert not [line for line in out.stdout.splitlines() if line.startswith("step ")]  # interval 5 > 3 steps
    (summary,) = _summaries(out.stdout)
    assert summary[5] == "" and summary[6] == ""
    assert float(summary[3]) > float(summary[4])  # the tiny model learns within three steps


def _demo_next():
    out = subprocess.run(["make", "-s", "demo-next", "PYTHON=python"], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return [line.split() for line in out.stdout.splitlines() if "launch/pretrain.py" in line]


# CI runs the first (pipeline, interleaved); make sweep the second too (ZeRO-3 with evaluation: test_hsdp's
# command line runs ZeRO-3 from the command line, test_periodic_evaluation_on_held_out_file evaluation)
@pytest.mark.parametrize("which", [0, pytest.param(1, marks=pytest.mark.sweep)])
def test_demo_next_commands_run_and_print_one_summary_from_four_ranks(tmp_path, which):
    commands = _demo_next()
    assert len(commands) == 2
    cmd = commands[which]
    assert cmd[:5] == ["python", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]
    out = _run([*cmd[5:], *SMALL, "train.steps=2", "train.eval_interval=2", "train.eval_steps=1"], nproc=4)
    summaries = _summaries(out.stdout)
    assert len(summaries) == 1 and summaries[0][0] == "2", shlex.join(cmd) + "\n" + out.stdout
