"""train.recompute_layers (issue 27 item 2): the first N transformer layers of every pipeline chunk are
recomputed whole, the others follow train.activation_checkpointing (Megatron's block method).

Exact: through the real Trainer and DistributedOptimizer every schedule matches the world-size-1 run without
recomputation (losses, logged grad norms, eval loss, weights after AdamW); memory: the dry run's activation
bytes fall as N grows; the planner's search tries N."""
from __future__ import annotations

import pytest

from ckpt_helpers import make_config
from parallel3d.planner.dryrun import run_role
from parallel3d.planner.hardware import gpu
from parallel3d.training.config import ConfigError
from test_pipeline_vshape_trainer import MOE, assert_parity, run
from test_planner import _stage_builder

DEEP = ["model.num_layers=8", "train.global_batch_size=8"]  # pp=2 x 2 chunks: 2 layers a chunk
CASES = [  # (world, layout incl. recompute, model)
    (2, ["parallel.pp=2", "parallel.schedule=1f1b", "train.recompute_layers=2",
         "train.activation_checkpointing=selective"], DEEP),
    (2, ["parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2", "train.recompute_layers=1"],
     DEEP),
    (2, ["parallel.pp=2", "parallel.schedule=gpipe", "train.recompute_layers=1"], ["model.num_layers=4"]),
    (2, ["parallel.pp=2", "parallel.schedule=zb-h1", "train.recompute_layers=1",
         "train.activation_checkpointing=selective"], ["model.num_layers=4"]),
    (2, ["parallel.pp=2", "parallel.schedule=zb-v", "train.recompute_layers=1"], [*DEEP, "model.tie_embeddings=true"]),
    (2, ["parallel.pp=2", "parallel.schedule=dualpipe-v", "train.recompute_layers=1",
         "train.activation_checkpointing=selective"], [*DEEP, *MOE]),
    (2, ["parallel.tp=2", "parallel.sp=true", "train.recompute_layers=1", "train.activation_checkpointing=selective"],
     ["model.num_layers=3", *MOE, "model.num_shared_experts=1"]),   # the fused SP entries recomputed
    (2, ["parallel.pp=2", "parallel.schedule=1f1b", "train.recompute_layers=5"], ["model.num_layers=4"]),  # clamped
    (4, ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true", "parallel.schedule=zb-h1", "train.recompute_layers=1"],
     ["model.num_layers=4"]),  # the weight pass through the fused SP entry (dW only: no dX, no reduce-scatter)
]


@pytest.mark.parametrize("world,layout,model", CASES, ids=lambda x: x if isinstance(x, int) else "-".join(
    o.split("=")[1] for o in x if o.startswith(("parallel.schedule", "parallel.tp", "train.recompute",
                                                 "train.activation", "model.num_experts"))))
def test_recompute_layers_match_world_size_1(worlds, world, layout, model):
    ref = run(None, model)  # world size 1, nothing recomputed
    assert_parity(worlds.run(world, run, [*layout, *model]), ref)


def _activations(n: int, recompute: str, moe: bool = False) -> int:
    cfg = make_config(["model.num_layers=4", "train.seq_len=64", "train.global_batch_size=1",
                       f"train.activation_checkpointing={recompute}", f"train.recompute_layers={n}",
                       *(MOE if moe else [])], 1)
    return run_role(cfg, 0, _stage_builder, gpu("h100"), 8).memory["activations"]


@pytest.mark.parametrize("recompute,moe", [("none", False), ("selective", False), ("none", True)])
def test_activation_bytes_fall_as_more_layers_are_recomputed(recompute, moe):
    got = [_activations(n, recompute, moe) for n in range(5)]
    assert all(a > b for a, b in zip(got, got[1:])), got
    full = make_config(["model.num_layers=4", "train.seq_len=64", "train.global_batch_size=1",
                        "train.activation_checkpointing=full", *(MOE if moe else [])], 1)
    # all 4 layers of the one chunk recomputed whole: what activation_checkpointing=full keeps
    assert got[4] == run_role(full, 0, _stage_builder, gpu("h100"), 8).memory["activations"]


@pytest.mark.parametrize("overrides,match", [
    (["train.recompute_layers=-1"], r"train.recompute_layers must be >= 0"),
    (["train.recompute_layers=2", "train.activation_checkpointing=full"],
     r"train.recompute_layers=2 has no effect with train.activation_checkpointing=full"),
])
def test_bad_recompute_layers_is_one_config_error(overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_config(overrides, 1)


def test_search_explores_recompute_layers():
    from parallel3d.planner.search import candidates, recompute_layer_options

    assert recompute_layer_options(8, "selective") == [0, 2, 4, 6]
    assert recompute_layer_options(8, "full") == [0] and recompute_layer_options(1, "none") == [0]
    cfg = make_config(["model.num_layers=8"], 2)
    found = {(c.parallel.pp, c.train.activation_checkpointing, c.train.recompute_layers)
             for c in candidates(cfg, 2, 8)}
    assert {(1, "none", 4), (1, "selective", 6), (2, "none", 2)} <= found
    assert not any(ac == "full" and n for _, ac, n in found)
