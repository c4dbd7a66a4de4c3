"""Whole-Llama parity under context parallelism (alone, with TP + SP, with DP) against world size 1.

Each rank feeds its load-balanced shard (inputs, labels and position ids split by the same
`shard_sequence` / `cp_chunk_indices`), the loss is the sum of token losses / global target-token count,
and gradients are reduced here the way the data-parallel code will: sum over DP x CP, plus over TP for
parameters whose meta.grad_reduce names "tp". Checked: loss (rel <= 1e-5), gathered gradients and
weights after 3 AdamW steps (rtol 1e-4; atol 1e-8 for grads, parity.WEIGHT_ATOL for weights).
"""
from __future__ import annotations

import pytest
import torch

from parallel3d.models.config import ModelConfig
from parallel3d.models.llama import IGNORE_INDEX, Llama
from parallel3d import comm
from parallel3d.context_parallel import cp_chunk_indices, shard_sequence
from parallel3d.mesh import MeshSpec, ParallelContext
from parity import PARITY_ADAM, WEIGHT_ATOL, assemble, assert_close_dicts, local_slices

BATCH, SEQ, STEPS = 2, 32, 3


def _cfg() -> ModelConfig:
    return ModelConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_hidden_size=64, max_seq_len=SEQ, kernels="torch")


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(11))
    labels = tokens[:, 1:].clone()
    labels[0, 5] = labels[1, 20] = labels[1, 31] = IGNORE_INDEX  # the global count excludes these
    return tokens[:, :-1], labels


def _train(ctx: ParallelContext, cp_mode: str, sp: bool) -> tuple:
    model = Llama(_cfg(), ctx, sequence_parallel=sp, cp_mode=cp_mode)
    model.init_weights(1234)
    ids, labels = _batch()
    n_tokens = int((labels != IGNORE_INDEX).sum())  # global target-token count
    cp, dp, (cp_r, dp_r) = ctx.spec.cp, ctx.spec.dp, (ctx.coords.cp, ctx.coords.dp)
    rows = slice(dp_r * BATCH // dp, (dp_r + 1) * BATCH // dp)  # this DP rank's sequences
    ids_l = shard_sequence(ids[rows], cp, cp_r)  # (b, s/cp)
    labels_l = shard_sequence(labels[rows], cp, cp_r)  # same split as the inputs
    pos_l = cp_chunk_indices(SEQ, cp, cp_r)  # (s/cp,) global positions for RoPE
    opt = torch.optim.AdamW(model.parameters(), **PARITY_ADAM)
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(ids_l, pos_l, labels_l) / n_tokens
        loss.backward()
        for p in model.parameters():
            comm.all_reduce(p.grad, ctx.dp_cp)
            if "tp" in p.meta.grad_reduce:
                comm.all_reduce(p.grad, ctx.tp)
        if step == 0:
            loss0 = comm.all_reduce(loss.detach().clone(), ctx.dp_cp).item()
            grads = local_slices(model, "grad")
        opt.step()
    return loss0, grads, local_slices(model, "data")


def _worker(w, spec: dict, cp_mode: str, sp: bool) -> tuple:
    return _train(w.context(MeshSpec(**spec)), cp_mode, sp)


@pytest.fixture(scope="module")
def reference():
    torch.manual_seed(0)
    loss, grads, weights = _train(ParallelContext.single(), "ring", False)
    return loss, assemble([grads]), assemble([weights])


@pytest.mark.parametrize("spec,cp_mode,sp", [
    (dict(cp=2), "ring", False),
    (dict(cp=4), "ring", False),
    (dict(cp=2, tp=2), "ring", True),
    (dict(cp=2, dp=2), "ring", False),
    (dict(cp=2), "allgather", False),
    (dict(cp=2), "ulysses", False),
], ids=["cp2", "cp4", "cp2-tp2-sp", "cp2-dp2", "cp2-allgather", "cp2-ulysses"])
def test_llama_cp_parity(worlds, reference, spec, cp_mode, sp):
    ref_loss, ref_grads, ref_weights = reference
    world = MeshSpec(**spec).world_size
    results = worlds.run(world, _worker, spec, cp_mode, sp, timeout=120)
    for loss, _, _ in results:
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    assert_close_dicts(assemble([g for _, g, _ in results]), ref_grads, rtol=1e-4, atol=1e-8, what="grad")
    assert_close_dicts(assemble([p for _, _, p in results]), ref_weights, rtol=1e-4, atol=WEIGHT_ATOL, what="weight")
    assert set(assemble([g for _, g, _ in results])) == set(ref_grads)
