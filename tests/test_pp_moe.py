"""MoE under pipeline parallelism: auxiliary losses of stages without the head reach the gradients."""
import pytest
import torch

from parallel3d.models.config import ModelConfig
from parallel3d.models.moe import MoETransformer
from parallel3d.data_parallel.grads import reduce_gradients
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.pipeline.partition import partition_layers
from parallel3d.pipeline.runtime import run_pipeline_step
from parity import assemble, assert_close_dicts, local_slices

KW = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=48,
          num_experts=4, moe_top_k=2, aux_loss_coef=0.5, z_loss_coef=0.1)
M, B, S = 3, 2, 8


def _batches():
    g = torch.Generator().manual_seed(0)
    t = torch.randint(0, 64, (M, B, S + 1), generator=g)
    return [{"ids": x[:, :-1], "labels": x[:, 1:], "position_ids": torch.arange(S)} for x in t]


def _reference():
    model = MoETransformer(ModelConfig(**KW), ParallelContext.single())
    model.init_weights(1)
    total = 0.0
    for mb in _batches():
        loss = model(mb["ids"], mb["position_ids"], mb["labels"]) / (M * B * S)
        loss.backward()
        total += loss.item()
    return {n: t for n, (t, _, _) in local_slices(model, "grad").items()}


def _worker(w, schedule):
    ctx = w.context(MeshSpec(pp=2))
    cfg = ModelConfig(**KW)
    stages = partition_layers(cfg.num_layers, 2)
    s = ctx.coords.pp
    chunk = MoETransformer(cfg, ctx, layers=stages[s], pre=s == 0, post=s == 1)
    chunk.init_weights(1)
    run_pipeline_step(ctx, [chunk], schedule, _batches(), loss_scale=1.0 / (M * B * S),
                      backward=lambda loss: (loss * 4.0).backward())  # a constant scale, like fp16's
    reduce_gradients(chunk.parameters(), ctx)
    for p in chunk.parameters():
        p.grad /= 4.0
    return local_slices(chunk, "grad")


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_moe_aux_loss_through_pipeline(worlds, schedule):
    ref = _reference()
    got = assemble(worlds.run(2, _worker, schedule))
    assert_close_dicts(got, ref, rtol=1e-4, atol=1e-7, what="grad")
    router = "layers.0.mlp.router.weight"  # on stage 0, shaped by the aux losses only through the fold
    assert router in got and got[router].abs().sum() > 0
