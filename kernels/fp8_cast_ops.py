"""train.fp8's casts as `torch.library` custom ops (fake implementations: meta tensors and the planner's dry run),
and the entry points kernels/dispatch.py calls: `cast` (amax, reduce, scale-cast) and `cast_given_amax`. An
eager call that nothing watches (`_triton_utils.direct`) runs the ops' bodies without the custom-op layer.
The kernels, launchers and the torch twin are in kernels/fp8_cast.py."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.library import custom_op

from parallel3d.kernels._triton_utils import direct
from parallel3d.kernels.fp8_cast import _out, amax_axis, amax_tensor, cast_axis, scale_cast


def _amax_shape(t: Tensor, axis: Optional[int]) -> tuple:
    return () if axis is None else ((t.shape[0], 1) if axis == 1 else (1, t.shape[1]))


def amax_of(t: Tensor, axis: Optional[int]) -> Tensor:
    """fp8_amax's body: the tensor's amax (axis None, shape ()) or per row / column."""
    return amax_tensor(t) if axis is None else amax_axis(t, axis)


def scale_cast_of(t: Tensor, amax: Tensor, axis: Optional[int], dtype: torch.dtype, col_major: bool = False
                  ) -> tuple[Tensor, Tensor]:
    """fp8_scale_cast's body: the cast pass with a given amax."""
    return (scale_cast(t, amax, dtype, col_major) if axis is None else
            cast_axis(t, axis, dtype, amax, col_major=col_major))


def cast_axis_of(t: Tensor, axis: int, dtype: torch.dtype, col_major: bool = False) -> tuple[Tensor, Tensor]:
    """fp8_cast_axis's body: the fused per row / column cast."""
    return cast_axis(t, axis, dtype, col_major=col_major)


@custom_op("parallel3d::fp8_amax", mutates_args=())
def fp8_amax(t: Tensor, axis: Optional[int]) -> Tensor:
    return amax_of(t, axis)


@fp8_amax.register_fake
def _(t, axis):
    return t.new_empty(_amax_shape(t, axis), dtype=torch.float32)


@custom_op("parallel3d::fp8_scale_cast", mutates_args=())
def fp8_scale_cast(t: Tensor, amax: Tensor, axis: Optional[int], dtype: torch.dtype, col_major: bool = False
                   ) -> tuple[Tensor, Tensor]:
    return scale_cast_of(t, amax, axis, dtype, col_major)


@fp8_scale_cast.register_fake
def _(t, amax, axis, dtype, col_major=False):
    return _out(t, dtype, col_major), t.new_empty(_amax_shape(t, axis), dtype=torch.float32)


@custom_op("parallel3d::fp8_cast_axis", mutates_args=())
def fp8_cast_axis(t: Tensor, axis: int, dtype: torch.dtype, col_major: bool = False) -> tuple[Tensor, Tensor]:
    return cast_axis_of(t, axis, dtype, col_major)


@fp8_cast_axis.register_fake
def _(t, axis, dtype, col_major=False):
    return _out(t, dtype, col_major), t.new_empty(_amax_shape(t, axis), dtype=torch.float32)


def cast(t: Tensor, dtype: torch.dtype, axis: Optional[int] = None, reduce_amax=None, col_major: bool = False
         ) -> tuple[Tensor, Tensor]:
    """The kernels' cast_reference through the custom ops: tensorwise amax op, (reduce), fused scale-cast op;
    axiswise one fused op, or amax op, reduce, cast op when the amax must be reduced first. Eager calls with
    nothing watching (`direct`) run the ops' bodies, without the custom-op layer."""
    amax_fn, scale_cast_fn, cast_axis_fn = _cast_ops(t)
    if axis is not None and reduce_amax is None:
        return cast_axis_fn(t, axis, dtype, col_major)
    amax = amax_fn(t, axis)
    return scale_cast_fn(t, amax if reduce_amax is None else reduce_amax(amax), axis, dtype, col_major)


def cast_given_amax(t: Tensor, amax: Tensor, dtype: torch.dtype, axis: Optional[int] = None
                    ) -> tuple[Tensor, Tensor]:
    """The cast pass alone with a given (already reduced) amax, through the op or its body as `cast` does."""
    return _cast_ops(t, amax)[1](t, amax, axis, dtype)


def _cast_ops(*tensors: Tensor) -> tuple:
    """(amax, scale-cast, axis cast): the custom ops, or their bodies for an eager call nothing watches."""
    if direct(*tensors):
        return amax_of, scale_cast_of, cast_axis_of
    return fp8_amax, fp8_scale_cast, fp8_cast_axis
