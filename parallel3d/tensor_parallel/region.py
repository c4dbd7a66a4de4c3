"""Entering the tensor-parallel region fused with the column-parallel GEMMs that read the entered input.

A block enters the TP region once (enter_tp_region) and several column-parallel layers read the result:
q, k and v in attention, gate and up in the MLP, the shared experts of an MoE layer. Done as separate
autograd ops, each GEMM saves the entered (b, s, h) input for its weight gradient; under sequence
parallelism that is the all-gathered sequence, tp times the (b, s/tp, h) shard the block received.
`column_entry` runs the entry and the GEMMs as one autograd Function that saves only what it was given
(Megatron's LinearWithGradAccumulationAndAsyncCommunication):

    forward    x (b, s/tp, h) --all-gather--> X (b, s, h);  Y_i = X @ W_i^T + b_i;  X is dropped
    backward   start the all-gather of the saved shard again (async)
               dX = sum_i dY_i @ W_i          (overlaps the gather on NCCL)
               reduce-scatter dX along the sequence -> (b, s/tp, h)
               wait for the gather;  dW_i = dY_i^T @ X,  db_i = sum over tokens of dY_i

Without sequence parallelism the entry is the identity forward and an all-reduce of dX backward; dX is
a fresh sum of GEMM outputs that nobody else holds, so it is reduced in place (no copy). The cost under
SP: one more all-gather per region in backward (the communication accounting records it). fp8 layers
(train.fp8) keep their numerics: the same quantised GEMMs as fp8.Fp8Linear, split into dX and dW parts.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.tensor_parallel import fp8
from parallel3d.tensor_parallel.mappings import SEQ_DIM


def _operands(layer, params: list[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor], str, Optional[tuple]]:
    """(weight, bias, fp8 kind, rows) of a column-parallel or KV layer: rows (lo, hi) for a replicated KV
    projection that computes only its head (its GEMM reads weight[lo:hi], the gradient fills those rows)."""
    weight, bias = params
    rows = getattr(layer, "row_range", None)
    return weight, bias, ("local" if rows is not None else "column"), rows


def _rows(t: Optional[torch.Tensor], rows: Optional[tuple]) -> Optional[torch.Tensor]:
    return t if t is None or rows is None else t[rows[0]:rows[1]]


def _gemm(x: torch.Tensor, layer, weight, bias, kind: str, rows) -> torch.Tensor:
    w, b = _rows(weight, rows), _rows(bias, rows)
    return fp8.linear(x, w, b, layer.fp8, kind, layer.group, layer.fp8_casts, layer)  # (b, s, out/tp)


def _gather_start(x: torch.Tensor, group: Group) -> tuple[torch.Tensor, Optional[object]]:
    """Start the all-gather of x (b, s/tp, h) along the sequence into a (tp, b, s/tp, h) buffer (x is
    sent as it is: no staging copy)."""
    buf = torch.empty((group.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    return buf, comm.start_all_gather(buf.view(-1), x.contiguous().view(-1), group)


def _gathered(buf: torch.Tensor) -> torch.Tensor:
    """(tp, b, s/tp, h) -> (b, s, h): a view when b == 1, else one copy."""
    tp, b, s_local, h = buf.shape
    return buf.transpose(0, 1).reshape(b, tp * s_local, h)


def will_run(node) -> bool:
    """Whether this backward needs the gradient of the entry's input: not in a zero-bubble weight pass
    (pipeline/backward.py differentiates towards the parameters only), which then skips dX and its
    reduce-scatter. Undecidable cases (a leaf input under autograd.grad) answer yes."""
    if node is None:
        return False
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return True


class _ColumnEntry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: Group, sp: bool, layers: tuple, *params):
        if sp:
            buf, work = _gather_start(x, group)
            comm.wait_work(work, group, "all_gather")
            full = _gathered(buf)  # (b, s, h)
        else:
            full = x
        outs = []
        for i, layer in enumerate(layers):
            weight, bias, kind, rows = _operands(layer, list(params[2 * i: 2 * i + 2]))
            outs.append(_gemm(full, layer, weight, bias, kind, rows))  # (b, s, out_i/tp)
        del full  # under sp only the shard x is kept: backward gathers it again
        ctx.group, ctx.sp, ctx.layers = group, sp, layers
        ctx.fp8w = [getattr(params[2 * i], "fp8", None) for i in range(len(layers))]
        ctx.save_for_backward(x, *params)
        return tuple(outs)

    # Y_i = X W_i^T + b_i:  dX = sum_i dY_i W_i (partial over TP, each rank has its rows of W_i: summed by
    # the reduce-scatter / all-reduce), dW_i = dY_i^T X, db_i = sum_tokens dY_i.
    @staticmethod
    def backward(ctx, *dys):
        x, *params = ctx.saved_tensors
        group, sp, layers = ctx.group, ctx.sp, ctx.layers
        pending = _gather_start(x, group) if sp else None  # overlaps the dX GEMMs below
        need_dx = ctx.needs_input_grad[0] and will_run(ctx.next_functions[0][0])
        dx, states = None, []
        for i, (layer, dy) in enumerate(zip(layers, dys)):
            weight, bias, kind, rows = _operands(layer, params[2 * i: 2 * i + 2])
            dy2 = dy.reshape(-1, dy.shape[-1])  # (n, out_i/tp)
            if not need_dx:
                states.append((dy2, None if layer.fp8 == "none" else
                               fp8.grad_state(dy2, layer.fp8, layer.group if kind == "column" else None,
                                              layer.fp8_casts)))
                continue
            if layer.fp8 == "none":
                part, state = dy2 @ _rows(weight, rows), None  # (n, h)
            else:
                state = fp8.grad_state(dy2, layer.fp8, layer.group if kind == "column" else None,
                                       layer.fp8_casts)
                part = fp8.grad_input(state, _rows(weight, rows), layer.fp8, kind, layer.group,
                                      ctx.fp8w[i] if rows is None else None, dy.dtype, layer.fp8_casts, layer)
            dx = part if dx is None else dx.add_(part)
            states.append((dy2, state))
        if dx is not None:
            dx = dx.view(*dys[0].shape[:-1], dx.shape[-1])  # (b, s, h) partial over TP
        if dx is not None:  # sp: (b, s/tp, h); else in place: dx is this Function's own sum
            dx = comm.reduce_scatter(dx, group, SEQ_DIM) if sp else comm.all_reduce(dx, group)
        if sp:
            buf, work = pending
            comm.wait_work(work, group, "all_gather")
            full = _gathered(buf)  # (b, s, h)
        else:
            full = x
        x2 = full.reshape(-1, full.shape[-1])  # (n, h)
        grads = []
        for i, (layer, (dy2, state)) in enumerate(zip(layers, states)):
            weight, bias, kind, rows = _operands(layer, params[2 * i: 2 * i + 2])
            dw = (dy2.t() @ x2 if state is None else fp8.grad_weight(state, x2, layer.fp8, weight.dtype,
                                                                          casts=layer.fp8_casts))
            if rows is not None:  # replicated KV: only this rank's head rows have a gradient here
                dw = torch.zeros_like(weight).index_copy_(0, torch.arange(*rows, device=dw.device), dw)
            db = None
            if bias is not None:
                db = dy2.sum(0)
                if rows is not None:
                    db = torch.zeros_like(bias).index_copy_(0, torch.arange(*rows, device=db.device), db)
            grads += [dw.to(weight.dtype), db]
        return (dx, None, None, None, *grads)


def column_entry(x: torch.Tensor, layers: Sequence[torch.nn.Module], group: Group, sequence_parallel: bool
                 ) -> list[torch.Tensor]:
    """[layer(enter_tp_region(x)) for layer in layers], saving only x for backward (module docstring).
    x: (b, s/tp, h) with sequence parallelism, else replicated (b, s, h). At tp=1 the plain layers run."""
    if group.size == 1:
        return [layer(x) for layer in layers]
    params = []
    for layer in layers:
        params += [layer.weight, layer.bias]
    return list(_ColumnEntry.apply(x, group, sequence_parallel, tuple(layers), *params))
