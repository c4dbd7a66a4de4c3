"""The dispatch all-to-all and the local experts as one autograd node, so that backward starts the dispatch's
all-to-all of the input gradient *before* the experts' weight gradients and computes them while it travels
(`model.moe_delay_wgrad`; Megatron-Core's delay_wgrad_compute).

    forward    rows (N_send, h) --a2a--> received (N_recv, h) --regroup--> x --experts--> y (N_recv, h)
    backward   dy -> d hidden -> d gate, d up -> dx  |start a2a(dx)|  dW_down, dW_gate, dW_up  |wait|

The plain path lets autograd run each expert projection's input and weight gradients together, then the
all-to-all: the weight-gradient GEMMs (a third of the experts' backward) sit before the transfer. Here they
sit beside it, on any schedule; inside an `ep_overlap` pair the turn goes to the partner after them.
Experts whole on each rank only (etp = 1: with etp > 1 the experts gather the etp ranks' rows themselves,
sp_dispatch.py). A zero-bubble input pass skips the weight gradients and a weight pass the input gradient
with its all-to-all, alike on every EP rank (the graph is the same; pipeline/backward.py).
"""
from __future__ import annotations

from typing import Sequence

import torch

from parallel3d.expert_parallel.experts import choose_impl, grouped_linear, grouped_weight_grad, offsets
from parallel3d.kernels import dispatch as kernels
from parallel3d.tensor_parallel.region import will_run


def check_delay_wgrad(ep: int, etp: int) -> None:
    """model.moe_delay_wgrad's requirements: an all-to-all to hide, whole experts."""
    if ep < 2 or etp != 1:
        raise ValueError(f"model.moe_delay_wgrad=true moves the experts' weight gradients beside the dispatch "
                         f"all-to-all: it needs parallel.ep > 1 and parallel.etp=1, got ep={ep} etp={etp}")


def _swiglu_grads(gate: torch.Tensor, up: torch.Tensor, dhid: torch.Tensor, backend: str
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden, d gate, d up) of hidden = swiglu(gate, up): the kernel's own forward and backward, on a graph
    of its own (no parameter in it, so no gradient hook fires)."""
    with torch.enable_grad():
        g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
        hid = kernels.swiglu(g, u, backend)  # (N, f)
        dgate, dup = torch.autograd.grad(hid, (g, u), dhid)
    return hid.detach(), dgate, dup


class DispatchedExperts(torch.autograd.Function):
    """rows (N_send, h) sorted by global expert -> (N_recv, h) the local experts' outputs, expert-major."""

    @staticmethod
    def forward(ctx, rows, w_gate, w_up, w_down, exchange, impl: str, backend: str):
        received = exchange.exchange_rows(rows, forward=True)[exchange.regroup]  # (N_recv, h) expert-major
        counts = exchange.local_counts
        impl = choose_impl(impl, received, received.shape[1], w_gate.shape[1])
        impl = "loop" if impl == "padded" else impl
        offs = offsets(counts, received.device) if impl == "grouped_mm" else None  # (E_local,)
        gate = grouped_linear(impl, received, counts, w_gate, offs=offs)  # (N_recv, f)
        up = grouped_linear(impl, received, counts, w_up, offs=offs)  # (N_recv, f)
        out = grouped_linear(impl, kernels.swiglu(gate, up, backend), counts, w_down, offs=offs)  # (N_recv, h)
        ctx.exchange, ctx.impl, ctx.backend, ctx.offs = exchange, impl, backend, offs
        ctx.save_for_backward(received, gate, up, w_gate, w_up, w_down)
        return out

    # y_e = swiglu(X_e Wg_e^T, X_e Wu_e^T) Wd_e^T over expert e's rows X_e (received from every source rank):
    #   dH_e = dY_e Wd_e,  (dG_e, dU_e) = swiglu'(dH_e),  dX_e = dG_e Wg_e + dU_e Wu_e
    #   d rows = the all-to-all of dX back to the rows' sources (splits swapped), ungrouped first
    #   dWd_e = dY_e^T H_e,  dWg_e = dG_e^T X_e,  dWu_e = dU_e^T X_e     while that all-to-all travels
    @staticmethod
    def backward(ctx, dout):
        received, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        ex, impl, offs, counts = ctx.exchange, ctx.impl, ctx.offs, ctx.exchange.local_counts
        need_x = ctx.needs_input_grad[0] and will_run(ctx.next_functions[0][0])
        need_w = [ctx.needs_input_grad[i] and will_run(ctx.next_functions[i][0]) for i in (1, 2, 3)]
        dout = dout.contiguous()
        dhid = grouped_linear(impl, dout, counts, w_down, True, offs)  # (N_recv, f)
        hid, dgate, dup = _swiglu_grads(gate, up, dhid, ctx.backend)
        pending = None
        if need_x:
            dx = grouped_linear(impl, dgate, counts, w_gate, True, offs)  # (N_recv, h)
            dx = dx.add_(grouped_linear(impl, dup, counts, w_up, True, offs))[ex.ungroup]  # source-major
            pending = ex.start_rows(dx, forward=False)  # travels under the weight gradients
        dwg = grouped_weight_grad(impl, dgate, received, counts, offs).to(w_gate.dtype) if need_w[0] else None
        dwu = grouped_weight_grad(impl, dup, received, counts, offs).to(w_up.dtype) if need_w[1] else None
        dwd = grouped_weight_grad(impl, dout, hid, counts, offs).to(w_down.dtype) if need_w[2] else None
        drows = ex.finish_rows(pending) if pending is not None else None  # (N_send, h)
        return drows, dwg, dwu, dwd, None, None, None


def dispatched_experts(exchange):
    """GroupedExperts.forward's `dispatched`: rows, the experts' (gate, up, down) weights, their impl and
    backend -> DispatchedExperts over `exchange`."""
    def run(rows: torch.Tensor, weights: Sequence[torch.Tensor], impl: str, backend: str) -> torch.Tensor:
        return DispatchedExperts.apply(rows, *weights, exchange, impl, backend)
    return run
