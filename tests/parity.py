"""Shared helpers for parity tests: run a model at some layout and compare with world size 1.

Workers return {name: (local real tensor, slices)}; the parent assembles global tensors from all ranks'
slices (no collectives needed), so any layout can be compared with the world-size-1 run.
"""
from __future__ import annotations

import torch

from parallel3d.params import real_part

# AdamW for parity runs. Adam's first update g / (|g| + eps) is nearly sign(g), so an element with a tiny
# gradient moves by up to lr * |dg| / eps for a gradient difference dg. A layout changes fp32 summation
# order (TP splits the matmul reduction, DP/CP sum partial gradients), giving |dg| ~ 1e-8 on gradients of
# size 1e-2; eps=1e-4 keeps that below 1e-6 while the update stays Adam's. Weights are compared with
# rtol 1e-4 and an absolute tolerance of 1e-5.
PARITY_ADAM = dict(lr=3e-3, eps=1e-4, weight_decay=0.1)
WEIGHT_ATOL = 1e-5  # about 0.3% of one step (lr)


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
