"""train.activation_offload through the real Trainer: saved activations really leave for host memory and
come back, and the run is identical to the run without offload (copies preserve values exactly)."""
from __future__ import annotations

import contextlib

import pytest
import torch

from parallel3d.offload import ActivationOffload
from test_trainer_regressions import run


BIGGER = ["train.seq_len=128", "model.hidden_size=64", "model.ffn_hidden_size=128"]  # activations > min_bytes


def _pair(worker, layout):
    layout = [*BIGGER, *layout]
    plain = run(worker, layout, 2)
    offloaded = run(worker, [*layout, "train.activation_offload=true"], 2)
    return plain, offloaded


@pytest.mark.parametrize("layout", [
    ["parallel.tp=2", "parallel.pp=2", "parallel.sp=true", "train.activation_checkpointing=selective"],
    ["parallel.pp=2", "parallel.tp=1", "parallel.zero=1", "train.activation_checkpointing=full",
     "model.num_experts=4", "model.moe_top_k=2", "model.moe_ffn_hidden_size=32"],
], ids=["tp-pp-sp-selective", "pp-dp-zero1-full-moe"])
def test_offload_is_exact_and_moves_activations(worlds, layout):
    for plain, offloaded in worlds.run(4, _pair, layout):
        assert [r["loss"] for r in offloaded["records"]] == [r["loss"] for r in plain["records"]]
        assert [r["grad_norm"] for r in offloaded["records"]] == [r["grad_norm"] for r in plain["records"]]
        for name, (t, _, _) in plain["weights"].items():
            assert torch.equal(offloaded["weights"][name][0], t), name
        assert all(r["activation_offload_bytes"] > 0 for r in offloaded["records"])
        assert all(r["activation_offload_bytes"] == 0 for r in plain["records"])


def _optimizer_pair(worker, layout):
    from test_sweep import run as run_with_masters  # fp32 master weights: held under every ZeRO stage

    return run_with_masters(worker, layout), run_with_masters(worker, [*layout, "parallel.offload_optimizer=cpu"])


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_optimizer_offload_is_exact(worlds, zero):
    """parallel.offload_optimizer=cpu keeps master weights and Adam state in host memory and steps there;
    the run equals the one without offload (on this CPU machine the homes coincide, but the code path --
    separate device parameters, host AdamW on a copy of the held gradient, device all-gather -- is the one
    a GPU run takes)."""
    layout = ["parallel.tp=2", f"parallel.zero={zero}", "train.precision=bf16" if zero == 2 else "train.precision=fp32"]
    # ZeRO-0/1 at dp 2 with several microbatches: offloaded, every microbatch is reduced and added on the
    # host, so the fp32 sums run in another order (tests/test_offload.py assert_identical): parity there,
    # bit equality for ZeRO-2/3, which reduce every microbatch either way.
    exact = zero >= 2
    for plain, offloaded in worlds.run(4, _optimizer_pair, layout):
        if exact:
            assert offloaded["losses"] == plain["losses"]
            assert offloaded["norms"] == plain["norms"]  # the logged norm sees a uniform gradient scale
        else:
            assert offloaded["losses"] == pytest.approx(plain["losses"], rel=1e-6)
            assert offloaded["norms"] == pytest.approx(plain["norms"], rel=1e-5)
        for name, (t, _, _) in plain["weights"].items():
            assert offloaded["weights"][name][0].device.type == "cpu"
            if exact:
                assert torch.equal(offloaded["weights"][name][0], t), name
            else:
                torch.testing.assert_close(offloaded["weights"][name][0], t, rtol=1e-4, atol=1e-6, msg=name)


def test_nvme_offload_without_a_directory_is_refused_clearly():
    from ckpt_helpers import make_config
    from parallel3d.training.config import ConfigError
    with pytest.raises(ConfigError, match="nvme needs parallel.offload_dir"):
        make_config(["parallel.offload_optimizer=nvme"], 1)


def _resume(worker, root):
    from ckpt_helpers import train

    layout = ["parallel.zero=1", "parallel.offload_optimizer=cpu"]
    full = train(worker, layout, 4)
    first = train(worker, layout, 2, save_root=root, save_at=[2])
    rest = train(worker, ["parallel.zero=2", "parallel.offload_optimizer=cpu"], 4, load=root)  # reshard too
    return full, first + rest


def test_offloaded_optimizer_state_checkpoints_and_resumes(worlds, tmp_path):
    for full, resumed in worlds.run(2, _resume, str(tmp_path / "ckpt")):
        assert resumed == pytest.approx(full, rel=1e-6)


def _chain_grads(offload=None, layers=6):
    """A chain of tanh(linear) layers, forward + backward under `offload`'s hooks: (loss, grads)."""
    def forward(ws):  # no activation outlives it but in the graph: each comes back from the host
        h = torch.randn(32, 64)
        for w in ws:
            h = torch.tanh(h @ w)  # (32, 64): saved for backward (8 KiB each)
        return h.square().sum()

    torch.manual_seed(0)
    ws = [torch.randn(64, 64, requires_grad=True) for _ in range(layers)]
    with offload.scope() if offload is not None else contextlib.nullcontext():
        loss = forward(ws)
        loss.backward()
    return loss.detach(), [w.grad for w in ws]


def test_backward_prefetches_the_activations_it_reaches_next(monkeypatch):
    """unpack(record j) issues the copies up of the records saved before j (what backward reaches next)
    before waiting for its own, bounded by prefetch_bytes; every copy is slowed so the copies really are
    in flight when the consumers run, and the gradients stay exact."""
    from test_offload_overlap import _slow
    from parallel3d.offload import streams

    plain_loss, plain_grads = _chain_grads()
    seen = []  # per unpack of an offloaded tensor: how many copies up had been issued when it was called

    def logged(off):
        orig = off._unpack
        def unpack(packed):
            if not isinstance(packed, torch.Tensor):  # weights (leaves) stay on the device as they are
                seen.append(len(off.fetch_log))
            return orig(packed)
        monkeypatch.setattr(off, "_unpack", unpack)
        return off

    for window, expect in ((1 << 30, "all at the first unpack"), (0, "one per unpack")):
        seen.clear()
        off = ActivationOffload(min_bytes=1024, prefetch_bytes=window)
        logged(off)
        with _slow(streams, "_copy", 0.01):
            loss, grads = _chain_grads(off)
        assert torch.equal(loss, plain_loss) and all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
        n = off.offloaded_tensors
        assert n >= 6 and sorted(off.fetch_log) == list(range(n)), off.fetch_log   # each fetched once
        unpacks = list(seen)
        if window:  # the first unpack (the last record) fetched itself and then every earlier record
            assert off.fetch_log == list(range(n - 1, -1, -1)) and unpacks[1:] == [n] * (len(unpacks) - 1), expect
        else:       # no window: each record is fetched when it is unpacked, none ahead
            assert unpacks == list(range(len(unpacks))), expect


def test_prefetch_goes_one_block_ahead_and_kept_tensors_come_back_as_themselves():
    """With blocks attached (the trainer passes each chunk's transformer blocks) an unpack fetches the rest
    of its block and the block before it, nothing further; a saved tensor something else still holds comes
    back as itself (no copy up); modified in place since pack, it is refused as autograd refuses it."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh()) for _ in range(4))
    off = ActivationOffload(min_bytes=1024)
    off.attach(blocks)

    def forward():
        h = torch.randn(32, 64)
        for b in blocks:
            h = b(h)  # saves the block's input (32, 64) and its tanh output
        return h.square().sum()

    with off.scope():
        loss = forward()
        groups = {}
        for ref in off._saved:
            groups.setdefault(ref().group, []).append(ref().index)
        loss.backward()
    last, before = sorted(groups)[-1], sorted(groups)[-2]
    first_unpack = len(groups[last]) + len(groups[before])  # the first unpack's own block and the one before
    assert sorted(off.fetch_log[:first_unpack]) == sorted(groups[last] + groups[before]), (off.fetch_log, groups)
    assert len(groups) == 5 and sorted(off.fetch_log)  # 4 blocks and the loss after them == sorted(i for g in groups.values() for i in g)

    kept = torch.randn(32, 64, requires_grad=True) * 1.0   # non-leaf, held by this test
    changed = torch.randn(32, 64, requires_grad=True) * 1.0
    a = kept.detach().requires_grad_()
    expected = torch.autograd.grad(a.square().sum() + (a * 2).tanh().sum(), [a])[0]
    off = ActivationOffload(min_bytes=1024)
    with off.scope():
        loss = kept.square().sum() + (kept * 2).tanh().sum()  # tanh saves its output (held by no one)
        grad = torch.autograd.grad(loss, [kept])[0]
        assert off.offloaded_tensors == 2 and len(off.fetch_log) == 1   # kept came back as itself
        assert torch.equal(grad, expected)
        loss = changed.square().sum()
        with torch.no_grad():
            changed.mul_(0.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            torch.autograd.grad(loss, [changed])


def test_a_changed_tensor_refuses_only_its_own_unpack():
    """A saved tensor changed in place that backward never unpacks (a branch the loss does not reach) does
    not break the prefetch scan of the records around it."""
    w = torch.randn(64, 64, requires_grad=True)
    off = ActivationOffload(min_bytes=1024)
    with off.scope():
        side = torch.randn(32, 64, requires_grad=True) * 1.0
        dead = side.square()                                 # saves `side`; never reaches the loss
        loss = torch.tanh(torch.randn(32, 64) @ w).sum()
        with torch.no_grad():
            side.mul_(2.0)
        loss.backward()
        del dead
    assert w.grad is not None and w.grad.abs().sum() > 0
