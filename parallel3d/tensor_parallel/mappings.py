"""Autograd-aware moves into and out of the tensor-parallel region. Each forward has its dual backward:

    function               forward                         backward
    copy_to_tp             identity                        all-reduce over TP
    reduce_from_tp         all-reduce over TP              identity
    scatter_to_tp          keep this rank's slice (dim)    all-gather (dim)
    gather_from_tp         all-gather (dim)                keep this rank's slice
    gather_from_sp         all-gather along the sequence   reduce-scatter along the sequence
    reduce_scatter_to_sp   reduce-scatter along sequence   all-gather along the sequence
    scatter_to_sp          keep this rank's sequence part  all-gather along the sequence

Sequence parallelism replaces copy_to_tp / reduce_from_tp by gather_from_sp / reduce_scatter_to_sp:
the same total volume, but activations outside the TP region hold s/tp of the sequence.
Tensors are (b, s, ...): the sequence dimension is 1.
"""
from __future__ import annotations

import torch

from parallel3d import comm
from parallel3d.comm import Group

SEQ_DIM = 1


def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {group.size} {group.name} ranks")
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        # g may be shared (an add's backward hands one tensor to both inputs): reduce a copy. The blocks'
        # entries avoid this mapping (region.column_entry reduces its own dX in place).
        return comm.all_reduce(g.contiguous().clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """In place: x is a fresh partial sum (a row-parallel GEMM's output) that nobody else holds. Were it
    saved for backward elsewhere, autograd's version check raises instead of using the summed values."""

    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return comm.all_reduce(x.contiguous(), group)  # the contiguous copy is fresh
        ctx.mark_dirty(x)
        return comm.all_reduce(x, group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return _split(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g, ctx.group, ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return comm.all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, ctx.dim), None, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, g):
        return comm.reduce_scatter(g, ctx.group, SEQ_DIM), None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.reduce_scatter(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, g):
        return comm.all_gather(g, ctx.group, SEQ_DIM), None


def copy_to_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Sum the partial x over TP, in place (x must be a fresh partial sum nobody else reads)."""
    return x if group.size == 1 else _ReduceFromTP.apply(x, group)


def scatter_to_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    return x if group.size == 1 else _ScatterToTP.apply(x, group, dim % x.dim())


def gather_from_tp(x: torch.Tensor, group: Group, dim: int = -1) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromTP.apply(x, group, dim % x.dim())


def gather_from_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFromSP.apply(x, group)


def reduce_scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceScatterToSP.apply(x, group)


def scatter_to_sp(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep this rank's part of the sequence (backward all-gathers): entering SP from replicated input."""
    return x if group.size == 1 else _ScatterToTP.apply(x, group, SEQ_DIM)
