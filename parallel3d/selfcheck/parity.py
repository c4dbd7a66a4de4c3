"""A layout's training run against world size 1's: the losses, the logged grad norms and the weights after the
optimizer steps, through the real Trainer and DistributedOptimizer.

Each rank compares the master-weight pieces it holds (each element of every weight is held by exactly one
rank, under any layout and ZeRO stage: DistributedOptimizer.state_tensors) with the same slices of the
world-size-1 run it ran itself, so no weights travel; only a summary per rank does (`local_summary`), and
`verdict` turns every rank's summaries into the mismatches, the same list on every rank.

Tolerances are the parity tests' (docs/architecture.md, section 2.2): fp32 loss rel 1e-5 per step, the
logged grad norm rel 1e-4 per step and rank (clipping and Adam cancel a uniform gradient scale in the
losses and weights; only the norm sees it), weights |got - ref| <= WEIGHT_ATOL + WEIGHT_RTOL |ref|.
"""
from __future__ import annotations

import torch

from parallel3d.data_parallel.state import base_name

LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4
WEIGHT_RTOL = 1e-4
WEIGHT_ATOL = 1e-5  # about 0.3% of one step at lr 3e-3


def train(trainer, steps: int) -> dict:
    """`steps` optimizer steps of a Trainer: {"losses", "norms", "weights": {name: [(held master piece, its
    global shape, its global slices), ...]}}."""
    records = [trainer.train_step() for _ in range(steps)]
    master = "master/"
    weights: dict[str, list] = {}
    for key, (t, shape, slices) in trainer.optimizer.state_tensors().items():
        if key.startswith(master):
            weights.setdefault(base_name(key)[len(master):], []).append((t.detach().clone(), tuple(shape), slices))
    return {"losses": [r["loss"] for r in records], "norms": [r["grad_norm"] for r in records], "weights": weights}


def full_weights(run: dict) -> dict[str, torch.Tensor]:
    """A world-size-1 run's weights as whole tensors (it holds every element in one piece)."""
    out = {}
    for name, pieces in run["weights"].items():
        (t, shape, _), = pieces
        out[name] = t.reshape(shape)
    return out


def weight_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| / (WEIGHT_ATOL / WEIGHT_RTOL + |ref|): at most WEIGHT_RTOL exactly where every element
    passes |got - ref| <= WEIGHT_ATOL + WEIGHT_RTOL |ref| (torch.testing.assert_close's rule), so one number
    says how close a tensor came, on the rtol scale, without dividing by weights near zero."""
    ref = ref.float()
    diff = (got.to(ref.device, torch.float32) - ref).abs()  # (piece,): an offloaded master lives on the host
    return float((diff / (WEIGHT_ATOL / WEIGHT_RTOL + ref.abs())).max()) if diff.numel() else 0.0


def local_summary(run: dict, reference: dict) -> dict:
    """This rank's side of the comparison, JSON-able: its losses and norms, the largest weight error of the
    pieces it holds (and which weight), the elements it holds, and any weight world size 1 has not."""
    ref = full_weights(reference)
    worst, worst_name, held, unknown = 0.0, "", 0, []
    for name, pieces in run["weights"].items():
        if name not in ref:
            unknown.append(name)
            continue
        for t, shape, slices in pieces:
            if tuple(shape) != tuple(ref[name].shape):
                unknown.append(f"{name} (shape {list(shape)} vs {list(ref[name].shape)})")
                continue
            err = weight_error(t.reshape(ref[name][slices].shape), ref[name][slices])
            held += t.numel()
            if err > worst or not worst_name:
                worst, worst_name = err, name
    return {"losses": run["losses"], "norms": run["norms"], "weight_error": worst, "worst_weight": worst_name,
            "held": held, "unknown": unknown}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a - b)


def verdict(summaries: list[dict], reference: dict) -> tuple[list[str], dict]:
    """(mismatches, errors) of every rank's summary against world size 1's run: each mismatch a sentence
    naming the step, rank and values; errors the largest relative error of the loss, grad norm and weights."""
    bad: list[str] = []
    ref_losses, ref_norms = reference["losses"], reference["norms"]
    total = sum(t.numel() for pieces in reference["weights"].values() for t, _, _ in pieces)
    errors = {"loss": 0.0, "grad_norm": 0.0, "weights": 0.0}
    for rank, s in enumerate(summaries):
        if len(s["losses"]) != len(ref_losses):
            bad.append(f"rank {rank} ran {len(s['losses'])} steps, world size 1 {len(ref_losses)}")
            continue
        for step, (got, want) in enumerate(zip(s["losses"], ref_losses)):
            errors["loss"] = max(errors["loss"], _rel(got, want))
            if not abs(got - want) <= LOSS_RTOL * abs(want):   # (a NaN fails too)
                bad.append(f"step {step} rank {rank}: loss {got:.7g} vs world size 1 {want:.7g} "
                           f"(rel err {_rel(got, want):.1e} > {LOSS_RTOL:g})")
        for step, (got, want) in enumerate(zip(s["norms"], ref_norms)):
            errors["grad_norm"] = max(errors["grad_norm"], _rel(got, want))
            if not abs(got - want) <= NORM_RTOL * abs(want):
                bad.append(f"step {step} rank {rank}: grad_norm {got:.7g} vs world size 1 {want:.7g} "
                           f"(rel err {_rel(got, want):.1e} > {NORM_RTOL:g})")
        errors["weights"] = max(errors["weights"], s["weight_error"])
        if not s["weight_error"] <= WEIGHT_RTOL:
            bad.append(f"rank {rank}: weights after {len(ref_losses)} steps, {s['worst_weight']} max rel err "
                       f"{s['weight_error']:.1e} > {WEIGHT_RTOL:g} (atol {WEIGHT_ATOL:g})")
        bad += [f"rank {rank}: weight {name} is not in the world-size-1 model" for name in s["unknown"]]
    held = sum(s["held"] for s in summaries)
    if held != total:
        bad.append(f"the ranks hold {held} master-weight elements, world size 1 has {total}")
    return bad, errors
