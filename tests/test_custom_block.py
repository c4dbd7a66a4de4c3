"""docs/custom_block.md, run as written: its block inside the reference model through the Trainer trains to
the same losses and weights under tensor (+ sequence), pipeline and ZeRO-3 parallelism as on one rank, the
model really is made of its blocks, and the guide's training snippet runs."""
import re
from pathlib import Path

import pytest
import torch

from ckpt_helpers import context_for, make_config
from parity import WEIGHT_ATOL, assemble, assert_close_dicts

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "custom_block.md"
PARITY = ["train.lr=3e-3", "train.eps=1e-4", "train.warmup_steps=0", "train.lr_schedule=constant",
          "model.num_layers=4", "train.seq_len=16", "train.global_batch_size=4", "train.micro_batch_size=1"]
STEPS = 3


def guide_code() -> list[str]:
    return re.findall(r"```python\n(.*?)```", GUIDE.read_text(), re.S)


def guide_namespace() -> dict:
    namespace: dict = {}
    exec(compile(guide_code()[0], str(GUIDE), "exec"), namespace)  # the guide's code, exactly as documented
    return namespace


def _train(worker, overrides):
    from parallel3d.training.trainer import Trainer

    torch.set_num_threads(1)
    cfg = make_config([*PARITY, *overrides], 1 if worker is None else worker.world_size)
    ctx = context_for(cfg, worker)
    trainer = Trainer(cfg, ctx, guide_namespace()["build_stage"](cfg, ctx))
    losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
    # the optimizer's fp32 master weights: held by some rank under every layout (ZeRO-3 frees the params)
    weights = {k[len("master/"):]: (t, slices, shape) for k, (t, shape, slices)
               in trainer.optimizer.state_tensors().items() if k.startswith("master/")}
    blocks = sorted({type(b).__name__ for c in trainer.chunks for b in c.layers.values()})
    return losses, weights, blocks


@pytest.fixture(scope="module")
def single():
    return _train(None, [])


def test_the_model_is_made_of_the_guides_blocks(single):
    losses, weights, blocks = single
    assert blocks == ["GeluBlock"]
    assert {n for n in weights if n.startswith("layers.0.")} == {
        "layers.0.attn_norm.weight", "layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight",
        "layers.0.attn.v_proj.weight", "layers.0.attn.o_proj.weight", "layers.0.mlp_norm.weight",
        "layers.0.fc1.weight", "layers.0.fc2.weight"}
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("layout", [["parallel.tp=2", "parallel.sp=true"], ["parallel.pp=2"],
                                    ["parallel.zero=3", "train.activation_offload=true"]],
                         ids=["tp2-sp", "pp2", "zero3-offload"])
def test_guide_block_trains_like_one_rank(worlds, single, layout):
    ref_losses, ref_weights, _ = single
    results = worlds.run(2, _train, layout)
    for losses, _, blocks in results:
        assert blocks == ["GeluBlock"]
        for a, b in zip(losses, ref_losses):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, ref_losses)
    got = assemble([r[1] for r in results])
    ref = assemble([ref_weights])
    assert_close_dicts(got, ref, rtol=1e-4, atol=WEIGHT_ATOL, what="weights")


def test_guide_training_snippet_runs(capsys):
    torch.set_num_threads(1)
    namespace = guide_namespace()
    exec(compile(guide_code()[1], str(GUIDE), "exec"), namespace)
    losses = [float(line) for line in capsys.readouterr().out.split()]
    assert len(losses) == 10 and losses[-1] < losses[0]
