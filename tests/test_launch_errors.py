"""Run-time errors through the command line: one line per rank that met the error, and exit code 2."""
from test_launch import SMALL, _run


def test_nan_policy_stop_ends_every_rank_with_one_line():
    # An absurd learning rate without clipping overflows the weights at the first update, so the second
    # step's loss is not finite; nan_policy=stop must end the run as a user error, not with a traceback.
    out = _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=1", *SMALL,
                "train.lr=1e30", "train.grad_clip=0", "train.warmup_steps=0", "train.nan_policy=stop"],
               nproc=2, check=False)
    assert out.returncode != 0
    # Every rank meets the non-finite step; whichever exits first makes torchrun end the other, so at least
    # one rank (not necessarily rank 0) says it, each in one line naming its rank.
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert lines and all(line.startswith(("error: [rank 0]", "error: [rank 1]")) for line in lines), out.stderr[-2000:]
    assert all("nan_policy=stop" in line for line in lines)
    assert "]: Traceback" not in out.stderr  # no worker traceback (torchrun's own report of the exit stays)


def test_flex_attention_on_a_cpu_run_is_refused_before_a_step():
    """model.attention=flex trains on CUDA only (torch has no FlexAttention backward on the CPU): one line
    per rank naming the setting and why, and a non-zero exit (torchrun's 1; each rank's is 2), before the first
    step's collectives."""
    out = _run(["launch/pretrain.py", "--config", "configs/tiny.yaml", "parallel.tp=2", *SMALL,
                "model.attention=flex", "data.document_masking=true", "data.eos_id=3"], nproc=2, check=False)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert lines and all("model.attention=flex cannot run here: torch's FlexAttention has no backward on the "
                         "CPU" in line for line in lines), out.stderr[-2000:]
    assert "loss" not in out.stdout, out.stdout[-1000:]   # no step ran
    assert "]: Traceback" not in out.stderr
