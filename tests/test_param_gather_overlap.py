"""ZeRO-1/2 parameter all-gathers overlapped with the next forward (issue 27 item 5, `overlap_param_gather`):
step() leaves each bucket's gather in flight and the bucket's first forward use waits for it (a forward
pre-hook on the blocks holding its parameters, the pattern of offload/publish.py).

Exact: the same losses, norms, gradients and weights as world size 1, through the DistributedOptimizer
harness and through the real Trainer (the optimizer it builds, with the option on). Order: after a step
every gather is still pending; entering layer i of the next forward, the buckets of the layers after it
are still pending, and by the end of that forward none is.
"""
from __future__ import annotations

import pytest
import torch

from ckpt_helpers import build_trainer, context_for, make_config
from parallel3d.mesh import MeshSpec
from test_dp_parity import BASE, S, SEED, check_parity, global_batches, reference, train
from test_zero_accumulation import check, run as trainer_run

OVERLAP = {"overlap_param_gather": True}


def _worker(w, zero, acc, chunks):
    return train(w.context(MeshSpec(dp=w.world_size)), BASE, zero, acc, opt_kwargs=OVERLAP, chunks=chunks)


@pytest.fixture(scope="module")
def ref():
    return reference(BASE)


@pytest.mark.parametrize("zero,acc,chunks", [(1, 1, False), (2, 2, False), (1, 2, True)])
def test_overlapped_gathers_match_world_size_1(worlds, ref, zero, acc, chunks):
    check_parity(worlds.run(2, _worker, zero, acc, chunks), ref)


@pytest.mark.parametrize("zero", [1, 2])
def test_overlapped_gathers_through_the_trainer(worlds, zero):
    layout = [f"parallel.zero={zero}", "train.global_batch_size=4",   # dp 2, 2 microbatches
              "parallel.overlap_param_gather=true"]
    check(worlds.run(2, trainer_run, layout, 3), trainer_run(None, ["train.global_batch_size=4"], 3),
          "fp32")


def _order(w):
    from parallel3d.data_parallel import DataParallelConfig, DistributedOptimizer
    from parallel3d.models.config import ModelConfig
    from parallel3d.models.llama import Llama

    ctx = w.context(MeshSpec(dp=w.world_size))
    model = Llama(ModelConfig(**{**BASE, "num_layers": 4}), ctx)
    model.init_weights(SEED)
    opt = DistributedOptimizer([model], ctx, DataParallelConfig(zero=2, bucket_size_mb=0.004, **OVERLAP))
    layer_of = {}   # bucket -> the first layer whose parameters it holds
    for i, blk in enumerate(model.layers.values()):
        for p in blk.parameters():
            for b in opt.buckets:
                if any(s.param is p for s in b.slots):
                    layer_of.setdefault(id(b), i)
    log = []
    for i, blk in enumerate(model.layers.values()):   # before the optimizer's own pre-hooks
        blk.register_forward_pre_hook(lambda m, a, i=i: log.append(
            (i, sorted(layer_of.get(k, -1) for k in opt.publisher._gathers))), prepend=True)
    tokens = global_batches(BASE["vocab_size"], 2)
    for step, batch in enumerate(tokens):
        mine = batch[w.rank * 8: (w.rank + 1) * 8]
        log.append(("step", step, len(opt.publisher._gathers)))
        opt.zero_grad()
        opt.scale_loss(model(mine[:, :-1], torch.arange(S), mine[:, 1:]) / 256).backward()
        opt.finish_grad_sync()
        opt.clip_grad_norm(1.0)
        opt.step(1e-3)
    log.append(("after", len(opt.publisher._gathers), len(opt.buckets)))
    return log


def test_the_gather_of_a_bucket_is_waited_by_its_first_module(worlds):
    log = worlds.run(2, _order)[0]
    assert log[0] == ("step", 0, 0) and log[-1][0] == "after" and log[-1][1] == log[-1][2] > 4
    second = log[log.index(next(e for e in log if e[:2] == ("step", 1))):]
    assert second[0][2] == log[-1][2]           # every gather of step 0 still pending when step 1 starts
    starts = [e for e in second if isinstance(e[0], int)]
    assert [i for i, _ in starts] == [0, 1, 2, 3]
    for i, pending in starts:   # entering layer i: the buckets of layers i.. are still in flight
        assert set(range(i, 4)) <= set(pending), (i, pending)
        assert not set(range(i)) & set(pending), (i, pending)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero12_gathers_land_in_the_parameters(zero):
    """ZeRO-1/2: the parameters are views of their bucket's flat buffer and each step's all-gather writes
    into that buffer in place, from this rank's segment of it: no gathered copy per bucket (which cost a
    bucket of memory and a copy into every parameter per step), and the parameters keep their storage."""
    from parallel3d.data_parallel import publishing

    cfg = make_config([f"parallel.zero={zero}", "parallel.bucket_size=2000"], 1)
    trainer = build_trainer(cfg, context_for(cfg))
    buckets = trainer.optimizer.buckets
    before = {id(s.param): s.param.data_ptr() for b in buckets for s in b.slots}
    gathers, start = [], publishing.start_all_gather

    def spy(out, inp, group):
        gathers.append((out, inp))
        return start(out, inp, group)
    publishing.start_all_gather = spy
    try:
        trainer.train_step()
    finally:
        publishing.start_all_gather = start
    assert len(buckets) > 4 and len(gathers) == len(buckets)
    for b, (out, inp) in zip(buckets, gathers):
        assert out is b.param_flat and inp.data_ptr() == out[b.shard * b.seg:].data_ptr()
        for s in b.slots:
            assert s.param.untyped_storage().data_ptr() == b.param_flat.untyped_storage().data_ptr()
            assert s.param.data_ptr() == before[id(s.param)]


def test_overlapped_gathers_under_sequence_parallel_small_buckets(worlds):
    """tp2 x dp2 with SP and a bucket per few tensors: the fused SP entry (tensor_parallel.column_entry) reads
    q/k/v's and gate/up's weights without calling those layers' forward, so a wait hung on their own
    modules would never fire and the forward would read last step's weights; each block waits instead."""
    layout = ["parallel.tp=2", "parallel.sp=true", "parallel.zero=1", "parallel.bucket_size=1000",
              "train.global_batch_size=4", "parallel.overlap_param_gather=true"]
    check(worlds.run(4, trainer_run, layout, 3), trainer_run(None, ["train.global_batch_size=4"], 3), "fp32")


def test_a_segment_is_rewritten_only_after_its_overlapped_gather():
    """overlap_param_gather: a gather lands in place from this rank's segment of the parameter buffer, so
    a bucket no forward waited for (its parameters unused) must finish its gather before the next step
    writes that segment: publishing waits for it first."""
    cfg = make_config(["parallel.zero=1", "parallel.bucket_size=2000", "parallel.overlap_param_gather=true"], 1)
    trainer = build_trainer(cfg, context_for(cfg))
    trainer.train_step()
    publisher = trainer.optimizer.publisher
    pending = [b for b in trainer.optimizer.buckets if id(b) in publisher._gathers]
    assert pending   # the step left its gathers to the next forward
    b = pending[0]
    publisher.publish_chunk(b, 0, b.seg, b.adam.master)
    assert id(b) not in publisher._gathers
