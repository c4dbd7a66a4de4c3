"""The multi-rank harness as a user's test suite sees it: test files outside tests/, run by
`python -m pytest -p parallel3d.testing` in a temporary directory, using the `multirank` fixture. One file
is docs/testing.md's code blocks as written (so the guide cannot drift); the other shows the failure reports."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "testing.md"

USER_TESTS = textwrap.dedent('''
    import torch
    import torch.distributed as dist


    def rank_sum(worker, scale, offset=0.0):
        t = torch.full((2,), float(worker.rank + 1), device=worker.device)
        dist.all_reduce(t)
        return (t * scale + offset).tolist(), worker.rank, worker.world_size


    def test_sum_on_two_ranks(multirank):
        results = multirank(rank_sum, 2, 10.0, offset=1.0)
        # 1 + 2 = 3 on every rank, times 10, plus 1; results come back in rank order
        assert results == [([31.0, 31.0], r, 2) for r in range(2)]


    def rank_one_disagrees(worker):
        t = torch.full((1,), float(worker.rank))
        dist.broadcast(t, src=0)
        assert worker.rank != 1, "rank 1 disagrees"


    def test_failing_rank(multirank):
        multirank(rank_one_disagrees, 2)


    def rank_zero_waits_alone(worker):
        if worker.rank == 0:  # rank 1 never joins: rank 0 hangs in this all_reduce
            dist.all_reduce(torch.ones(3, 4))


    def test_hang(multirank):
        multirank(rank_zero_waits_alone, 2, timeout=4)


    def test_default_world_size_is_two(multirank):
        assert [r[1:] for r in multirank(rank_sum, scale=1.0)] == [(0, 2), (1, 2)]
''')


def test_multirank_fixture_from_a_users_suite(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    (tmp_path / "test_guide.py").write_text("\n\n".join(re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "parallel3d.testing", "-p", "no:cacheprovider",
                          "-q", "-rA", "test_user.py", "test_guide.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text  # two of the user's tests fail, on purpose
    assert re.search(r"2 failed, 5 passed", text), text
    for name in ("test_all_reduce", "test_tp_mlp_matches_one_rank", "test_tp_mlp_dry_run_on_meta"):
        assert f"PASSED test_guide.py::{name}" in text, text
    assert "PASSED test_user.py::test_sum_on_two_ranks" in text, text
    assert "PASSED test_user.py::test_default_world_size_is_two" in text, text
    # a rank that raises: the failure names the rank and carries its traceback and message
    assert "rank_one_disagrees failed on 2 ranks" in text, text
    assert "rank 1 raised" in text and "AssertionError: rank 1 disagrees" in text, text
    # a hang: after the timeout, the stuck rank and the collective it is in (operation and tensor)
    assert "rank_zero_waits_alone timed out after 4s on 2 ranks" in text, text
    assert "rank 0 still running after 4s, last collective: torch.distributed.all_reduce(tensor (3, 4) float32)" \
        in text, text
