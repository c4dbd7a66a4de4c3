"""Offload copies beside compute (parallel3d/offload/streams.py): ordering, read-ahead, refusals.

The copy engine runs on a worker thread on the CPU (a side stream on CUDA) with the same control flow, so
these tests check what CUDA relies on: every consumer waits for its own copy. They slow the copies down
(or the NVMe reads) and require the offloaded run to stay identical to the run without offload; the
negative controls show that, with a wait missing, the slowed run does go wrong.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ckpt_helpers import build_trainer, context_for, make_config
from parallel3d.offload import streams
from parallel3d.offload.streams import CopyEngine, check_copy
from test_offload import PARITY, _pair, accumulates_before_reducing, assert_identical, nvme


class _slow:
    """Every copy-engine copy (or NVMe read) sleeps `delay` s first, on whatever thread runs it."""

    def __init__(self, module, name, delay):
        self.module, self.name, self.delay = module, name, delay

    def __enter__(self):
        self.orig = getattr(self.module, self.name)

        def slow(*args, **kwargs):
            time.sleep(self.delay)
            return self.orig(*args, **kwargs)
        setattr(self.module, self.name, slow)

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.orig)


# ---- the engine ----------------------------------------------------------------------------------------
def test_copy_engine_consumer_waits_for_a_slow_copy():
    engine = CopyEngine(torch.device("cpu"))
    dst, src = torch.zeros(1000), torch.arange(1000.0)
    with _slow(streams, "_copy", 0.3):
        ticket = engine.copy(dst, src)
        assert not ticket.done() and dst.sum() == 0   # issued, not landed: the caller went on at once
        second = engine.copy(dst[:10], torch.full((10,), -1.0))   # first in, first out (like a stream)
        second.wait()
    assert ticket.done() and torch.equal(dst[10:], src[10:]) and torch.equal(dst[:10], torch.full((10,), -1.0))
    engine.close()


def test_synchronous_engine_copies_at_once():
    engine = CopyEngine(torch.device("cpu"), synchronous=True)
    dst = torch.zeros(5)
    assert engine.copy(dst, torch.ones(5)).done() and torch.equal(dst, torch.ones(5))


def test_unsafe_copies_are_refused():
    with FakeTensorMode():   # stand-ins for device tensors (no GPU here)
        dev, other = torch.empty(8, device="cuda:0"), torch.empty(8, device="cuda:1")
    cuda = torch.device("cuda:0")
    with pytest.raises(ValueError, match="source is a host tensor that is not pinned"):
        check_copy(cuda, dev, torch.empty(8))            # pageable host memory behind a non_blocking copy
    with pytest.raises(ValueError, match="destination is a host tensor that is not pinned"):
        check_copy(cuda, torch.empty(8), dev)
    with pytest.raises(ValueError, match="destination is on cuda:1"):
        check_copy(cuda, other, dev)
    with pytest.raises(ValueError, match="same dtype"):
        check_copy(cuda, dev, dev.half())
    with pytest.raises(ValueError, match="source is on meta"):
        CopyEngine(torch.device("cpu")).copy(torch.empty(8), torch.empty(8, device="meta"))
    with pytest.raises(ValueError, match="meta-device stand-in"):
        CopyEngine(torch.device("meta"))


# ---- through the Trainer: slowed copies, identical training ----------------------------------------------
CPU = ["parallel.offload_optimizer=cpu"]
SLOWED = {  # layout: who waits for the copies
    "dp2-zero0-bf16": ["parallel.zero=0", "train.precision=bf16"],      # module forward pre-hooks
    "tp2-sp-dp2-zero1": ["parallel.tp=2", "parallel.sp=true", "parallel.zero=1"],  # all-gathers; tp-reduced norms
    "pp2-dp2-zero2": ["parallel.pp=2", "parallel.zero=2"],
    "dp4-zero3-bf16": ["parallel.zero=3", "train.precision=bf16"],        # the prefetcher
}


def _slow_pair(worker, layout, offload, delay):
    with _slow(streams, "_copy", delay):
        return _pair(worker, layout, offload)


@pytest.mark.parametrize("case", list(SLOWED))
def test_slow_gradient_and_parameter_copies_train_identically(worlds, case):
    results = worlds.run(4 if "dp4" in case or "tp2" in case or "pp2" in case else 2,
                         _slow_pair, SLOWED[case], CPU, 0.005)
    assert any(plain["masters"] for plain, _ in results)   # ZeRO-0: only DP rank 0 holds (saves) the state
    for plain, off in results:
        if not plain["masters"]:
            plain["masters"] = off["masters"] = {"-": torch.zeros(1)}
        assert_identical(plain, off, exact=not accumulates_before_reducing(SLOWED[case]) and "dp2-zero0" not in case)


def test_missing_forward_wait_is_caught():
    """Negative control: without the ZeRO-0 forward pre-hooks the forward reads parameters whose copy has
    not landed, and the slowed run differs (so the identical runs above are evidence of the waits)."""
    from parallel3d.offload.publish import DevicePublish
    layout = ["parallel.zero=0", "train.precision=bf16"]
    plain = _pair(None, layout, CPU, 2)[0]
    hooks = DevicePublish.hooks
    DevicePublish.hooks = lambda self, buckets, modules: []
    try:
        with _slow(streams, "_copy", 0.3):
            off = _pair(None, layout, CPU, 2)[1]
    finally:
        DevicePublish.hooks = hooks
    assert off["losses"][1] != plain["losses"][1]


def test_cpu_offload_fp16_overflow_skip_identical(worlds):
    """fp16: host gradients are unscaled and clipped like the device ones; skipped steps drain the copies."""
    layout = ["parallel.zero=1", "train.precision=fp16", "train.initial_loss_scale=4e5", "train.loss_scale_window=2"]
    for plain, off in worlds.run(2, _pair, layout, CPU, 5):
        assert any(plain["skipped"]) and not all(plain["skipped"])
        assert_identical(plain, off, exact=False)   # ZeRO-1, dp 2, 2 microbatches


def test_gradient_copies_leave_during_backward():
    """Each bucket's copy to the host is issued when its reduction completes, inside backward (world 1:
    reductions complete at once), in every microbatch, not at the optimizer step; the run is still the
    plain one (world 1: the host adds the microbatches in the order the device buffer would)."""
    from parallel3d.params import in_backward
    layout = ["parallel.zero=1", "parallel.bucket_size_mb=0.01"]   # ~2.5k-element buckets: many of them
    torch.set_num_threads(1)
    cfg = make_config([*PARITY, *layout, *CPU], 1)
    trainer = build_trainer(cfg, context_for(cfg))
    issued = []
    start = trainer.optimizer.homes.host_grads.start
    trainer.optimizer.homes.host_grads.start = lambda b, g: (issued.append(in_backward()), start(b, g))
    losses = [trainer.train_step()["loss"] for _ in range(2)]
    n = len(trainer.optimizer.buckets)
    trainer.optimizer.close()
    # every bucket of every microbatch (offloaded, each backward's reduction leaves at once, host_grads.py)
    assert n >= 4 and cfg.train.num_microbatches == 4 and len(issued) == 2 * n * 4
    assert all(issued), issued   # every bucket (ZeRO-1 world 1: the last one too) left inside backward
    cfg = make_config([*PARITY, *layout], 1)
    plain = build_trainer(cfg, context_for(cfg))
    assert [plain.train_step()["loss"] for _ in range(2)] == losses


# ---- NVMe parameter read-ahead ---------------------------------------------------------------------------
def _order(tmp_path, read_ahead: bool, delay: float = 0.0):
    """One training step of a 4-layer ZeRO-3 model with parameters on NVMe; the log of fetch issues and
    of each layer's forward start, and the threads the reads ran on."""
    from parallel3d.offload import files
    torch.set_num_threads(1)
    cfg = make_config([*PARITY, "parallel.zero=3", "model.num_layers=4", *nvme(str(tmp_path), "params")], 1)
    trainer = build_trainer(cfg, context_for(cfg))
    opt = trainer.optimizer
    opt.zero3.read_ahead = read_ahead
    index = {id(u): i - 1 for i, u in enumerate(opt.zero3.chains[0])}   # root -1, layer i -> i
    log, threads = [], set()
    fetch = opt.zero3.fetch

    def recorded(b):
        log.append(("fetch", index[id(b.unit)]))
        return fetch(b)
    opt.zero3.fetch = recorded
    for i in range(4):
        trainer.chunks[0].layers[str(i)].register_forward_pre_hook(
            lambda m, a, i=i: log.append(("start", i)), prepend=True)   # before ZeRO-3's own pre-hook
    read = files.StateFiles.read

    def traced(self, *args):
        threads.add(threading.current_thread().name)
        return read(self, *args)
    files.StateFiles.read = traced
    try:
        with _slow(files.StateFiles, "read", delay):
            losses = [trainer.train_step()["loss"] for _ in range(2)]
    finally:
        files.StateFiles.read = read
    masters = {k: v[0].clone() for k, v in opt.state_tensors().items()}
    opt.close()
    return log, threads, losses, masters


def test_nvme_reads_run_ahead_of_the_forward(tmp_path):
    log, threads, losses, masters = _order(tmp_path, read_ahead=True, delay=0.01)
    first = {e: log.index(e) for e in reversed(log)}   # first occurrence of each event
    for i in range(3):   # layer i+1's read is issued before layer i's forward starts
        assert first[("fetch", i + 1)] < first[("start", i)], log
    assert "MainThread" not in threads   # after construction, every read runs on the I/O thread
    # the slowed reads change nothing: equal to ZeRO-3 without offload
    torch.set_num_threads(1)
    cfg = make_config([*PARITY, "parallel.zero=3", "model.num_layers=4"], 1)
    plain = build_trainer(cfg, context_for(cfg))
    assert [plain.train_step()["loss"] for _ in range(2)] == losses
    for k, v in plain.optimizer.state_tensors().items():
        assert torch.equal(v[0], masters[k]), k
    # negative control: without read-ahead the read of layer i+1 waits for layer i's start
    log, *_ = _order(tmp_path, read_ahead=False)
    first = {e: log.index(e) for e in reversed(log)}
    assert all(first[("fetch", i + 1)] > first[("start", i)] for i in range(3)), log


@pytest.mark.gpu
def test_cuda_engine_orders_the_consumer_stream():
    """CUDA: copies on the side stream, the consumer's stream waits on the event (not run without a GPU)."""
    from parallel3d.offload.files import host_buffer
    engine = CopyEngine(torch.device("cuda", torch.cuda.current_device()))
    src = torch.randn(1 << 24, device="cuda")
    host = host_buffer(src.numel(), torch.float32, pin=True)
    engine.copy(host, src * 2).synchronize()            # device -> host; the source is a temporary
    assert torch.equal(host, (src * 2).cpu())
    back = torch.empty_like(src)
    engine.copy(back, host).wait()                       # host -> device, then used on the current stream
    assert torch.equal(back * 1, src * 2)
    engine.close()
