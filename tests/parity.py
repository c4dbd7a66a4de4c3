"""Shared helpers for parity tests: run a model at some layout and compare with world size 1.

Workers return {name: (local real tensor, slices)}; the parent assembles global tensors from all ranks'
slices (no collectives needed), so any layout can be compared with the world-size-1 run.
"""
from __future__ import annotations

import torch

from parallel3d.params import real_part
from parallel3d.selfcheck.parity import NORM_RTOL, WEIGHT_ATOL  # noqa: F401 (the parity tolerances' owner)

# AdamW for parity runs. Adam's first update g / (|g| + eps) is nearly sign(g), so an element with a tiny
# gradient moves by up to lr * |dg| / eps for a gradient difference dg. A layout changes fp32 summation
# order (TP splits the matmul reduction, DP/CP sum partial gradients), giving |dg| ~ 1e-8 on gradients of
# size 1e-2; eps=1e-4 keeps that below 1e-6 while the update stays Adam's. Weights are compared with
# rtol 1e-4 and an absolute tolerance of 1e-5.
PARITY_ADAM = dict(lr=3e-3, eps=1e-4, weight_decay=0.1)


def local_slices(model: torch.nn.Module, what: str = "grad") -> dict:
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if what == "grad" else p.data
        out[name] = (real_part(t, p.meta).detach().clone(), p.meta.slices, p.meta.global_shape)
    return out


def assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Global tensors from every rank's slices (tied copies keep the first name seen). A key "name#i" is a
    further piece of `name` (a rank's range of a parameter cut into boxes: data_parallel/state.py)."""
    out: dict[str, torch.Tensor] = {}
    for part in per_rank:
        for key, (t, slices, shape) in part.items():
            name = key.split("#")[0]
            if name not in out:
                out[name] = torch.full(shape, float("nan"), dtype=t.dtype)
            out[name][slices] = t
    return out


def assert_close_dicts(got: dict, ref: dict, rtol: float = 1e-4, atol: float = 1e-6, what: str = "") -> None:
    assert set(got) <= set(ref), f"{what}: unexpected names {set(got) - set(ref)}"
    for name, t in got.items():
        assert not torch.isnan(t).any(), f"{what} {name}: some slice was never filled"
        torch.testing.assert_close(t, ref[name], rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}")


def enlarge_weights(model: torch.nn.Module) -> torch.nn.Module:
    """Hugging Face parity: weights large enough that RoPE, the norms, attention and routing all move the
    logits far beyond the comparison tolerance (with std 0.02 attention is nearly uniform)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.25)
    return model


def load_imported(ckpt_dir: str, model_cls: type, **overrides) -> torch.nn.Module:
    """Our model (world size 1) with the weights of a native checkpoint, config fields overridable."""
    from parallel3d.models.config import ModelConfig
    from parallel3d.checkpoint.load import load_model_weights
    from parallel3d.checkpoint.store import CheckpointReader
    from parallel3d.mesh import ParallelContext

    reader = CheckpointReader(ckpt_dir)
    model = model_cls(ModelConfig(**{**reader.meta["model"], **overrides}), ParallelContext.single()).eval()
    load_model_weights(reader, [model])
    return model


# The logged grad_norm, per step, against world size 1. Clipping and Adam's normalisation cancel a uniform
# scale of every gradient: doubling every gradient leaves the losses and the weights after clipped AdamW
# steps unchanged (grad_norm 2.84 vs 1.42 passed both), so every parity harness compares the norm too, with
# the weights' relative tolerance (the norm is one fp32 sum of squares over a layout's shards): NORM_RTOL,
# owned by parallel3d/selfcheck/parity.py with WEIGHT_ATOL, which launch/selftest.py holds layouts to.


def assert_grad_norms(got: list[list[float]], ref: list[float], rtol: float = NORM_RTOL, what: str = "") -> None:
    """Every rank's logged grad_norm of every step (all-reduced: each rank reports the global norm) equals
    world size 1's within rtol."""
    assert ref and all(n > 0 for n in ref), f"{what}: world size 1 logged no gradient norm {ref}"
    for rank, norms in enumerate(got):
        assert len(norms) == len(ref), f"{what} rank {rank}: {len(norms)} grad norms vs {len(ref)}"
        for step, (g, e) in enumerate(zip(norms, ref)):
            assert abs(g - e) <= rtol * abs(e), f"{what} step {step} rank {rank}: grad_norm {g} vs world size 1 {e}"


def double_every_gradient(monkeypatch) -> None:
    """Mutant for the tests of the harnesses: every gradient x2 (the loss is doubled on its way into
    backward, through DistributedOptimizer.scale_loss, which every Trainer path calls; the logged loss is
    not). In-process runs only (world size 1): a harness must fail when one side carries it."""
    from parallel3d.data_parallel import DistributedOptimizer

    original = DistributedOptimizer.scale_loss
    monkeypatch.setattr(DistributedOptimizer, "scale_loss", lambda self, loss: 2 * original(self, loss))
