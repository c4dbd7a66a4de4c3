"""FP8 linear layers (train.fp8=tensorwise|rowwise, with train.precision=bf16): the matmuls of the
column-, row- and KV-parallel layers run in float8 through `torch._scaled_mm` with current (dynamic)
scaling; parameters stay bf16, the fp32 master weights and the optimizer are untouched.

    y  = x @ W^T      x: e4m3, W: e4m3                                  forward
    dx = dy @ W       dy: e5m2 (tensorwise) / e4m3 (rowwise), W: e4m3    backward, input gradient
    dW = dy^T @ x     dy as above, x: e4m3                               backward, weight gradient

A tensor is quantised as t8 = saturate(t * s), s = fp8_max / amax, and the product is rescaled by the
inverse scales (scale_a, scale_b of _scaled_mm). The recipes (TorchTitan/torchao's names):
  tensorwise   one scale per tensor; gradients in e5m2 (range over precision)
  rowwise      one scale per row of each operand along the contraction dimension (axiswise), e4m3
               everywhere; more accurate, each GEMM re-quantises its operands along its own axis

Tensor parallelism. Scales are computed on this rank's shards; where the amax would differ from the
unsharded tensor's, it is all-reduced (MAX) over the TP group, so every element is quantised exactly as in
the world-size-1 run (layout-independent numerics up to summation order):
  tensorwise  every TP-sharded operand: the weight always; x of a row-parallel layer (split along in);
              dy of a column-parallel layer (split along out)
  rowwise     only where the contraction dimension is split: x and W of a row-parallel layer (forward);
              dy and W of a column-parallel layer (dx); never for dW (tokens are not TP-split)
Under sequence parallelism x is all-gathered before the column-parallel matmul, so it is whole.
The LM head (and the fused head) and the MoE expert GEMMs stay in bf16; replicated KV projections
(tp > num_kv_heads) scale on their own rank. Layers are switched by
parallel3d.tensor_parallel.layers.convert_to_fp8, which also tags each column/row weight with an
`Fp8Weight` (`weight.fp8`): what ZeRO-3 needs to gather that weight already in fp8
(parallel.zero3_fp8_gather, data_parallel/fp8_gather.py). While such a gathered copy is present the GEMMs
take it (bytes and inverse scale) instead of quantising the weight; the copy holds exactly the bytes the
quantisation here would produce, so the results are bit-identical.

Casting. Every quantisation is kernels.dispatch.fp8_cast: the fused Triton kernels of kernels/fp8_cast.py on
CUDA (and on `meta`, as their custom ops), their torch twin elsewhere, with the same bytes. The TP amax
all-reduce runs between the amax pass and the cast pass. Weights are cast once per optimizer step, not per
microbatch: an `Fp8Casts` owner (one per model, handed to its fp8 layers by convert_to_fp8) keeps each
weight's fp8 copies while the trainer has it open (see Fp8Casts).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from parallel3d import comm
from parallel3d.comm import Group
from parallel3d.kernels import dispatch

RECIPES = ("none", "tensorwise", "rowwise")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def check_fp8(recipe: str, precision: str, local_dims: Optional[dict] = None) -> None:
    """train.fp8 needs bf16 training (the fp8 GEMMs write bf16), and every rank-local feature dimension of
    the linears (`local_dims`: name -> size) divisible by 16, which torch._scaled_mm requires."""
    if recipe not in RECIPES:
        raise ValueError(f"train.fp8 must be one of {', '.join(RECIPES)}, got {recipe!r}")
    if recipe != "none" and precision != "bf16":
        raise ValueError(f"train.fp8={recipe} needs train.precision=bf16 (got {precision})")
    bad = {k: v for k, v in (local_dims or {}).items() if v % 16}
    if recipe != "none" and bad:
        raise ValueError(f"train.fp8={recipe} needs every linear's per-rank feature size divisible by 16 "
                         f"(float8 matmuls); not: " + ", ".join(f"{k}={v}" for k, v in bad.items()))


FP8_CAPABILITY = (8, 9)   # float8 tensor cores: Ada (sm_89), Hopper (sm_90) and later


def check_fp8_hardware(recipe: str, name: str, has_fp8: bool) -> None:
    """train.fp8 needs float8 tensor cores: on a GPU without them torch._scaled_mm fails in the first forward,
    and a plan would price its GEMMs at a peak the GPU cannot reach. `has_fp8`: the device's compute
    capability for a run (check_fp8_device), the GPU table's fp8 peak for a plan (planner/estimate.py)."""
    if recipe != "none" and not has_fp8:
        raise ValueError(f"train.fp8={recipe} needs float8 tensor cores (compute capability "
                         f"{FP8_CAPABILITY[0]}.{FP8_CAPABILITY[1]} or newer: L4, L40S, H100, H200, B200); "
                         f"{name} has none: use train.fp8=none")


def check_fp8_device(recipe: str, device: torch.device) -> None:
    """check_fp8_hardware for the device a run's linears live on (a CPU emulates the float8 GEMMs: _mm)."""
    if recipe != "none" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        check_fp8_hardware(recipe, f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})",
                           (major, minor) >= FP8_CAPABILITY)


@dataclass
class Fp8Weight:
    """The fp8 identity of a column/row-parallel weight (`layer.weight.fp8`, set by convert_to_fp8) and the
    copies ZeRO-3 gathered in fp8: axis -> (e4m3 (out, in), fp32 inverse scale). Axis None: one scale
    (tensorwise); 1: one per row (out, 1) (rowwise forward); 0: one per column (1, in) (rowwise dx)."""
    recipe: str
    kind: str                       # "column" | "row": which of its dimensions TP splits
    group: Optional[Group]
    gathered: dict = field(default_factory=dict)


def weight_axes(recipe: str, backward: bool) -> tuple[Optional[int], ...]:
    """The scale axes of the weight operand the GEMMs of one pass use (forward: y; backward: dx)."""
    return (None,) if recipe == "tensorwise" else ((0,) if backward else (1,))


def weight_reduce_group(kind: str, group: Optional[Group], axis: Optional[int]) -> Optional[Group]:
    """The group over which the weight's amax along `axis` is MAX-reduced (None: no reduction): the TP
    group exactly where the reduced dimension is TP-split (module docstring)."""
    tp = group if group is not None and group.size > 1 and kind != "local" else None
    if axis is None:
        return tp
    return tp if kind == ("row" if axis == 1 else "column") else None


class Fp8Casts:
    """The fp8 casting of one model: which kernels cast (model.kernels: `backend`), and the weights' fp8
    copies, reused across the microbatches of an optimizer step.

    Reuse is scoped explicitly: between open() and close() (Trainer.train_step, around the step's forwards
    and backwards, where no parameter changes: the optimizer, its ZeRO-1/2 publishing, checkpoint loads and
    everything else run outside) each weight is cast once per scale axis (tensorwise: one copy serves y and
    dx, kept twice: row-major for y and transposed for dx, whose GEMM takes W^T contiguous; rowwise: a
    row-scaled copy for y, a column-scaled transposed one for dx) and the copy reused by every later
    microbatch, recomputed forward and backward. close() drops the copies: nothing is held between steps,
    so no copy can outlive the weights it was cast from. The scope is what makes reuse correct: the optimizer
    writes parameters through `.data` and flat buffers, which the parameter's version counter does not see.
    Each copy still records the weight's storage pointer, shape and version counter, and a mismatch inside a
    step (an in-place write to the parameter itself) casts again.
    Closed (evaluation, a test's own loop) every use casts, as does code under torch.compile (a cached
    Python object cannot live in the graph). The trainer does not open it under ZeRO-3, whose weights are
    gathered for each use and freed again: copies kept for the step would hold 2 bytes per parameter of the
    unsharded model that ZeRO-3 exists not to hold (its fp8 gathers cast the shard instead).
    `weight_casts` counts the weight casts made (the tests read it)."""

    def __init__(self, backend: str = "auto") -> None:
        self.backend = backend
        self.reuse = False
        self.copies: dict = {}  # (layer, axis, col_major) -> ((data_ptr, shape, version), (w8, inverse scale))
        self.weight_casts = 0

    def open(self) -> None:
        self.reuse, self.copies = True, {}

    def close(self) -> None:
        self.reuse, self.copies = False, {}

    def weight(self, key: object, axis: Optional[int], w: torch.Tensor, cast, col_major: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The copy of weight `w` (of layer `key`) along `axis`: reused while open and unchanged, else cast().
        col_major: laid out as dx's GEMM takes it (W^T contiguous): the step's row-major copy transposed once
        if there is one (tensorwise: y's), else cast into that layout (rowwise's column-scaled copy).
        cast(col_major) -> (w8 (out, in), inverse scale)."""
        if torch.compiler.is_compiling():
            return cast(col_major)
        stamp = (w.data_ptr(), tuple(w.shape), w._version)
        hit = self.copies.get((key, axis, col_major)) if self.reuse else None
        if hit is not None and hit[0] == stamp:
            return hit[1]
        row = self.copies.get((key, axis, False)) if col_major and self.reuse else None
        if row is not None and row[0] == stamp:
            out = (_col_major(row[1][0]), row[1][1])
        else:
            self.weight_casts += 1
            out = cast(col_major)  # (out, in)
        if self.reuse:
            self.copies[(key, axis, col_major)] = (stamp, out)
        return out


def casts_of(models) -> list[Fp8Casts]:
    """The distinct Fp8Casts of the fp8 layers in `models` (convert_to_fp8 hands one to each layer)."""
    found = {id(c): c for m in models for mod in m.modules() if (c := getattr(mod, "fp8_casts", None)) is not None}
    return list(found.values())


def _backend(casts: Optional[Fp8Casts]) -> str:
    return "auto" if casts is None else casts.backend


def _cast(t: torch.Tensor, axis: Optional[int], group: Optional[Group], dtype: torch.dtype, backend: str,
          col_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(t8, fp32 inverse scale) of a 2-D t along `axis` (None: one scale); the amax MAX-reduced over `group`
    (if given) between the amax pass and the cast pass; col_major: t8 written transposed (_mm's layouts)."""
    reduce = None if group is None else (lambda a: comm.all_reduce(a, group, op="max"))
    return dispatch.fp8_cast(t, dtype, axis, reduce, backend, col_major)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def _mm(a8: torch.Tensor, a_inv: torch.Tensor, b8: torch.Tensor, b_inv: torch.Tensor, out_dtype: torch.dtype
        ) -> torch.Tensor:
    """(M, K) @ (K, N) in fp8; a row-major, b column-major; inverse scales scalar or (M, 1) / (1, N).

    On a CPU, the product the GPU's fp8 GEMM computes, from fp32 copies: every fp8 value is exact in fp32,
    every product of two is exact too (at most 4 + 4 significant bits), the sums round in fp32 as the
    GEMM's fp32 accumulator does, then the scales and the rounding to out_dtype. torch's own CPU
    _scaled_mm took 24 ms for a (128, 64) @ (64, 32) product here (this: 0.5 ms with the copies), which made
    an fp8 run of the test model 8x slower than bf16; it agrees with this to the summation order."""
    if a8.device.type == "cpu":
        return ((a8.float() @ b8.float()) * a_inv * b_inv).to(out_dtype)   # (M, N)

    def dense(s: torch.Tensor) -> torch.Tensor:  # (k, 1) views of (1, k) keep a stride _scaled_mm rejects
        return s if s.dim() == 0 else s.flatten().view(s.shape)
    return torch._scaled_mm(a8.contiguous(), _col_major(b8), scale_a=dense(a_inv), scale_b=dense(b_inv),
                            out_dtype=out_dtype)


def _weight8(weight: torch.Tensor, axis: Optional[int], kind: str, group: Optional[Group],
             tag: Optional[Fp8Weight] = None, casts: Optional[Fp8Casts] = None, key: object = None,
             col_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight (out, in) in e4m3 with scales along `axis`: ZeRO-3's gathered fp8 copy when there is one
    (its bytes are what this quantisation gives: fp8_gather.py), else the step's copy in `casts` (col_major:
    stored transposed, the layout dx's GEMM takes: Fp8Casts.weight), else cast here."""
    tag = tag if tag is not None else getattr(weight, "fp8", None)
    if tag is not None and tag.gathered:
        if axis not in tag.gathered:
            raise RuntimeError(f"the weight was gathered in fp8 with scale axes {list(tag.gathered)}, this GEMM "
                               f"needs axis {axis} (a forward recomputed in backward under rowwise?)")
        return tag.gathered[axis]

    def cast(col_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return _cast(weight, axis, weight_reduce_group(kind, group, axis), E4M3, _backend(casts), col_major)
    return cast(col_major) if casts is None else casts.weight(key, axis, weight, cast, col_major)


class Fp8Linear(torch.autograd.Function):
    """y = x @ W^T with fp8 operands; kind "column" | "row" | "local" says which operands are TP-sharded
    (local: none reduced); see the module docstring for the scales and reductions."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, recipe: str, kind: str, group: Optional[Group],
                casts: Optional[Fp8Casts] = None, key: object = None) -> torch.Tensor:
        tp = group if group is not None and group.size > 1 and kind != "local" else None
        row, col = (tp if kind == "row" else None), (tp if kind == "column" else None)
        x2 = x.reshape(-1, x.shape[-1])  # (n, in)
        axis = None if recipe == "tensorwise" else 1  # rowwise: scales (n, 1) and (out, 1)
        x8, x_inv = _cast(x2, axis, row, E4M3, _backend(casts))  # (n, in)
        w8, w_inv = _weight8(weight, axis, kind, group, None, casts, key)  # (out, in)
        y = _mm(x8, x_inv, w8.t(), w_inv if axis is None else w_inv.t(), x.dtype)  # (n, out)
        ctx.save_for_backward(x, weight)  # x itself: a saved view (x2) trips torch.compile's autograd capture
        ctx.args = (recipe, row, col, kind, group, x.shape, casts, key)
        ctx.fp8w = getattr(weight, "fp8", None)  # ZeRO-3's fp8 copy is read again in backward, if gathered
        return y  # (n, out): reshaped outside, so the output is no view made inside a Function (which
        # an in-place reduction of it, tensor_parallel.mappings.reduce_from_tp, may not modify)

    # dx = dy @ W contracts over out; dW = dy^T @ x contracts over the n tokens.
    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight = ctx.saved_tensors
        recipe, row, col, kind, group, x_shape, casts, key = ctx.args
        x2 = x.reshape(-1, x.shape[-1])  # (n, in)
        state = grad_state(dy.reshape(-1, dy.shape[-1]), recipe, col, casts)  # dy (n, out)
        dx = grad_input(state, weight, recipe, kind, group, ctx.fp8w, dy.dtype, casts, key)  # (n, in)
        dw = grad_weight(state, x2, recipe, weight.dtype, row, casts)  # (out, in)
        return dx.view(x_shape), dw, None, None, None, None, None


# The backward of Fp8Linear in parts, so a caller can compute dx before x is at hand (tensor_parallel.region
# gathers x again under sequence parallelism while dx is computed).
def grad_state(dy2: torch.Tensor, recipe: str, col: Optional[Group], casts: Optional[Fp8Casts] = None) -> tuple:
    """dy (n, out) quantised for the dx GEMM (rows over out; amax MAX-reduced over `col` where out is split)."""
    if recipe == "tensorwise":
        return (dy2,) + _cast(dy2, None, col, E5M2, _backend(casts))
    return (dy2,) + _cast(dy2, 1, col, E4M3, _backend(casts))  # scales (n, 1)


def grad_input(state: tuple, weight: torch.Tensor, recipe: str, kind: str, group: Optional[Group],
               tag: Optional[Fp8Weight], dtype: torch.dtype, casts: Optional[Fp8Casts] = None, key: object = None
               ) -> torch.Tensor:
    """dx (n, in) = dy @ W in fp8 (rowwise: W's scales (1, in), columns over out)."""
    _, g8, g_inv = state
    w8, w_inv = _weight8(weight, None if recipe == "tensorwise" else 0, kind, group, tag, casts, key, True)
    return _mm(g8, g_inv, w8, w_inv, dtype)


def grad_weight(state: tuple, x2: torch.Tensor, recipe: str, dtype: torch.dtype, row: Optional[Group] = None,
                casts: Optional[Fp8Casts] = None) -> torch.Tensor:
    """dW (out, in) = dy^T @ x in fp8 (x (n, in); tensorwise: x's amax MAX-reduced over `row`). The casts
    made for this GEMM alone are written in the layouts _mm takes (dy^T row-major, x column-major)."""
    dy2, g8, g_inv = state
    backend = _backend(casts)
    if recipe == "tensorwise":
        x8, x_inv = _cast(x2, None, row, E4M3, backend, col_major=True)  # (n, in) stored (in, n)
        return _mm(g8.t(), g_inv, x8, x_inv, dtype)
    gt8, gt_inv = _cast(dy2, 0, None, E4M3, backend, col_major=True)  # (n, out) stored (out, n); (1, out)
    x8, x_inv = _cast(x2, 0, None, E4M3, backend, col_major=True)  # (n, in) stored (in, n); (1, in)
    return _mm(gt8.t(), gt_inv.t(), x8, x_inv, dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, recipe: str = "none",
           kind: str = "local", group: Optional[Group] = None, casts: Optional[Fp8Casts] = None,
           key: object = None) -> torch.Tensor:
    """F.linear, or its fp8 version when recipe is tensorwise / rowwise (the bias is added in bf16).
    casts / key: the model's Fp8Casts and the calling layer (its weight copies' key), or None."""
    if recipe == "none":
        return F.linear(x, weight, bias)
    y = Fp8Linear.apply(x, weight, recipe, kind, group, casts, key).view(*x.shape[:-1], weight.shape[0])  # (.., out)
    return y if bias is None else y + bias
