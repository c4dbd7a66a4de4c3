"""The layout search enumerates MoE parallel folding: every (ep, etp) the mesh folds over a stage's
tp x cp x dp ranks (mesh_spec.expert_folds, the owner of the rule), not only ep dividing dp x cp at the
config's etp."""
from __future__ import annotations

import warnings

import pytest

from ckpt_helpers import make_config
from parallel3d.mesh_spec import check_expert_fold, expert_folds
from parallel3d.planner.search import candidates, expert_layouts, prior
from parallel3d.planner.hardware import gpu

MOE = ["model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=128"]


def _folds_by_brute_force(tp: int, cp: int, dp: int) -> set:
    ok = set()
    for ep in range(1, 17):
        for etp in range(1, 17):
            try:
                check_expert_fold(tp, cp, dp, ep, etp)
            except ValueError:
                continue
            ok.add((ep, etp))
    return ok


@pytest.mark.parametrize("tp,cp,dp", [(1, 1, 1), (2, 1, 2), (2, 2, 1), (4, 1, 2), (1, 1, 6)])
def test_expert_folds_are_exactly_what_the_mesh_accepts(tp, cp, dp):
    assert set(expert_folds(tp, cp, dp)) == _folds_by_brute_force(tp, cp, dp)


def test_search_enumerates_ep_and_etp_under_the_fold():
    cfg = make_config(MOE, 1)
    # a stage of tp2 x dp2, 4 experts of ffn 128: every fold with etp at most tp
    assert expert_layouts(cfg, 2, 1, 2) == [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]
    assert expert_layouts(cfg, 1, 1, 4) == [(1, 1), (2, 1), (4, 1)]     # etp > tp: valid, left to a plan by hand
    assert expert_layouts(make_config(["model.num_experts=3", "model.moe_top_k=1", "model.moe_ffn_hidden_size=96"], 1),
                          2, 1, 3) == [(1, 1), (3, 1), (1, 2), (3, 2)]  # num_experts % ep, ffn % etp: the experts' rule
    assert expert_layouts(make_config([], 1), 2, 1, 2) == [(1, 1)]   # dense
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # layouts validation warns about are weighed, not announced
        found = candidates(cfg, 4, 8)
    folds = {(c.parallel.tp, c.parallel.dp, c.parallel.ep, c.parallel.etp) for c in found}
    # ep=4 > dp*cp=2 (EP over TP x DP), experts split like the MLP (etp=tp), and whole experts with copies
    assert {(2, 2, 4, 1), (2, 2, 2, 2), (2, 2, 2, 1), (2, 2, 1, 1), (4, 1, 1, 4), (4, 1, 4, 1), (1, 4, 4, 1)} <= folds
    assert all(c.parallel.etp <= c.parallel.tp for c in found)
    for c in found:
        p = c.parallel
        check_expert_fold(p.tp, p.cp, p.dp, p.ep, p.etp)


def test_prior_prices_the_expert_exchange_on_its_link():
    """Only the order of the dry runs: an EP group inside a node is cheaper than across nodes."""
    h100 = gpu("h100")
    batch = "train.global_batch_size=8"
    cfg = make_config([*MOE, batch, "parallel.tp=2", "parallel.ep=4", "parallel.etp=2"], 16)   # EP over 8 ranks
    assert prior(cfg, h100, 8)[1] < prior(cfg, h100, 4)[1]


def test_plan_search_cli_enumerates_the_folds_quietly():
    """`launch/plan.py --search` takes the folded layouts (its count is candidates()'s, which holds them) and
    prints no ConfigWarning for the layouts it weighs; its progress lines name etp."""
    import subprocess
    import sys
    from pathlib import Path

    from parallel3d.models.config import ModelConfig
    from parallel3d.training.config import load_config

    moe = ["model.num_experts=4", "model.moe_top_k=2"]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "launch/plan.py", "--config", "configs/tiny.yaml", "--world-size", "4",
                           "--search", "--json", "--max-candidates", "1", *moe], cwd=root, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = candidates(load_config(str(root / "configs" / "tiny.yaml"), moe, ModelConfig), 4, 8)
    assert {(c.parallel.ep, c.parallel.etp) for c in found if c.parallel.tp == 2} >= {(4, 1), (2, 2)}
    assert f"{len(found)} valid layouts" in proc.stderr and " etp=" in proc.stderr
    assert "ConfigWarning" not in proc.stderr
