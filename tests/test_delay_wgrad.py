"""model.moe_delay_wgrad: the dispatch all-to-all and the local experts as one node, whose backward starts the
input gradient's all-to-all before the experts' weight gradients and computes them while it travels
(parallel3d/expert_parallel/delayed_wgrad.py; issue 50 item 3, Megatron-Core's delay_wgrad_compute).

What must hold: the backward's order (start, the three weight-gradient GEMMs, wait); the layer's gradients
equal the plain path's; and the run is the world-size-1 run through the Trainer on the strict backend, alone,
inside ep_overlap pairs, under full recomputation and under a zero-bubble split backward.
"""
from __future__ import annotations

import pytest
import torch

from parallel3d import comm
from parallel3d.expert_parallel import delayed_wgrad
from parallel3d.expert_parallel.layer import MoELayer
from parallel3d.mesh import MeshSpec, ParallelContext
from parallel3d.params import init_parameters
from ckpt_helpers import make_config
from test_ep_overlap import matches_world_size_1
from test_strict_backend import MOE


def _layer(delay: bool) -> tuple[MoELayer, ParallelContext]:
    ctx = ParallelContext.simulated(MeshSpec(dp=2, ep=2), 0, "cpu", "gloo")
    torch.manual_seed(0)
    layer = MoELayer(16, 32, 4, 2, ctx, impl="loop", backend="torch", delay_wgrad=delay)
    init_parameters(layer, seed=3)
    return layer, ctx


def test_the_weight_gradients_run_while_the_input_gradient_travels(monkeypatch):
    layer, _ = _layer(True)
    events = []
    start, wait, wgrad = comm.start_all_to_all, comm.wait_work, delayed_wgrad.grouped_weight_grad
    monkeypatch.setattr(comm, "start_all_to_all", lambda *a, **k: (events.append("start"), start(*a, **k))[1])
    monkeypatch.setattr(comm, "wait_work", lambda w, g, op: (events.append(f"wait {op}"), wait(w, g, op))[1])
    monkeypatch.setattr(delayed_wgrad, "grouped_weight_grad", lambda *a, **k: (events.append("dW"), wgrad(*a, **k))[1])
    x = torch.randn(2, 8, 16, requires_grad=True)
    events.clear()
    layer(x).square().sum().backward()
    assert events == ["start", "dW", "dW", "dW", "wait all_to_all"], events


def test_the_layers_gradients_are_the_plain_paths():
    x = torch.randn(2, 8, 16)
    grads = {}
    for delay in (False, True):
        layer, _ = _layer(delay)
        xi = x.clone().requires_grad_()
        out = layer(xi)
        out.square().sum().backward()
        grads[delay] = (out.detach(), xi.grad, {n: p.grad for n, p in layer.named_parameters()})
    torch.testing.assert_close(grads[True][0], grads[False][0])
    torch.testing.assert_close(grads[True][1], grads[False][1], rtol=1e-5, atol=1e-6)
    for name, g in grads[False][2].items():
        torch.testing.assert_close(grads[True][2][name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_refusals_name_the_keys():
    with pytest.raises(ValueError, match="parallel.ep > 1 and parallel.etp=1"):
        delayed_wgrad.check_delay_wgrad(1, 1)
    with pytest.raises(ValueError, match="got ep=2 etp=2"):
        delayed_wgrad.check_delay_wgrad(2, 2)
    from parallel3d.training.config import ConfigError
    with pytest.raises(ConfigError, match="moe_delay_wgrad"):
        make_config(["model.moe_delay_wgrad=true", *MOE], 1)


DELAY = ["model.moe_delay_wgrad=true", "train.micro_batch_size=1"]
CASES = {
    "dp2-ep2": (2, ["parallel.dp=2", "parallel.ep=2", "train.global_batch_size=8", *MOE]),
    "dp2-ep2-ep_overlap-full-recompute": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.ep_overlap=true",
                                              "train.activation_checkpointing=full", "train.global_batch_size=8",
                                              *MOE]),
    # ZeRO-3 gathers the experts' weights for the node's forward and again for its backward
    "dp2-ep2-zero3": (2, ["parallel.dp=2", "parallel.ep=2", "parallel.zero=3", "train.global_batch_size=8", *MOE]),
    # the split backward: the input pass skips the weight gradients, the weight pass the all-to-all
    "pp2-zb-h1-dp2-ep2-zero1": (4, ["parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "parallel.zero=1",
                                    "parallel.schedule=zb-h1", "model.num_layers=4", "train.global_batch_size=8",
                                    *MOE]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_delayed_weight_gradients_match_world_size_1_on_the_strict_backend(multirank, name):
    matches_world_size_1(multirank, *CASES[name], DELAY)


def test_the_dry_run_prices_the_input_gradients_all_to_all_beside_the_weight_gradients():
    """The meta dry run runs the node too: each backward's dispatch all-to-all is started before the weight
    gradients and waited after them, so on an H100 part of it hides (its blocking share falls) while the
    forward's exchanges and the work (FLOPs) are unchanged."""
    from parallel3d.planner.dryrun import run_role
    from parallel3d.planner.hardware import gpu
    from test_planner import SMALL, _stage_builder
    runs = {}
    for delay in ("false", "true"):
        cfg = make_config([*SMALL, *MOE, "parallel.dp=2", "parallel.ep=2", f"model.moe_delay_wgrad={delay}"], 2)
        runs[delay] = run_role(cfg, 0, _stage_builder, gpu("h100"), 8)
    off, on = runs["false"], runs["true"]
    assert on.flops == pytest.approx(off.flops, rel=1e-6)
    fwd, bwd = ("FORWARD", 0), ("BACKWARD", 0)
    assert on.actions[fwd].blocking_comm_s == pytest.approx(off.actions[fwd].blocking_comm_s)
    assert on.actions[bwd].overlapped_comm_s > 0 == off.actions[bwd].overlapped_comm_s
    assert on.actions[bwd].blocking_comm_s < off.actions[bwd].blocking_comm_s
