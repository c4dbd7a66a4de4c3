"""Megatron tensor-parallel layers. With a TP group of size 1 each is an ordinary PyTorch layer.

Weights are stored (out, in) as in nn.Linear; y = x @ W^T. Shapes: b batch, s sequence, tp the TP size.
With sequence parallelism (sp) activations outside the TP region are (b, s/tp, h).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from parallel3d.kernels import dispatch
from parallel3d.comm import Group
from parallel3d.tensor_parallel import fp8
from parallel3d.params import ParamMeta, full_slices, new_param, shard_slices
from parallel3d.tensor_parallel.mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                                                 reduce_scatter_to_sp)


def enter_tp_region(x: torch.Tensor, group: Group, sequence_parallel: bool) -> torch.Tensor:
    """(b, s/tp, h) with sp or replicated (b, s, h) -> replicated (b, s, h) input of column-parallel layers.

    Do this once per block and build the block's column-parallel layers with enter_region=False, so a
    Megatron block costs one collective on the way in (in backward without sp) and one on the way out.
    """
    return gather_from_sp(x, group) if sequence_parallel else copy_to_tp(x, group)


def vocab_shard(vocab: int, tp: int, rank: int) -> tuple[int, int, int]:
    """(start, real_rows, local_rows): vocab padded to a multiple of tp; padding sits at the end."""
    per = -(-vocab // tp)
    start = min(rank * per, vocab)
    return start, min(per, vocab - start), per


class ColumnParallelLinear(nn.Module):
    """Output features split over TP.

        X (b, s, in) replicated          W = [W_0; W_1; ...] rows split      Y_r = X @ W_r^T  (b, s, out/tp)
        ┌──────────┐                     rank r holds W_r (out/tp, in)      optionally all-gathered to (b, s, out)

    enter_region: apply copy-to-TP (or the SP all-gather) to the input here. vocab_size: treat `out` as a
    vocabulary padded to a multiple of tp (LM head); padding rows are zero and never enter checkpoints.
    """

    def __init__(self, in_features: int, out_features: int, group: Group, sequence_parallel: bool = False,
                 enter_region: bool = True, gather_output: bool = False, vocab_padding: bool = False,
                 std: Optional[float] = None, bias: bool = False) -> None:
        super().__init__()
        self.group, self.sp, self.enter_region, self.gather_output = group, sequence_parallel, enter_region, gather_output
        if vocab_padding:
            start, real, local = vocab_shard(out_features, group.size, group.rank)
            slices = (slice(start, start + real), slice(0, in_features))
        else:
            local = out_features // group.size
            slices = shard_slices((out_features, in_features), 0, group.rank, group.size)
        self.out_local = local
        # the vocabulary head is no hidden matrix (Muon leaves it to AdamW)
        self.weight = new_param((local, in_features), ParamMeta((out_features, in_features), slices, std=std,
                                                                matrix=not vocab_padding))
        self.bias = None
        if bias:  # split like the output rows (zeros at init, as nn.Linear biases in Hugging Face models)
            self.bias = new_param((local,), ParamMeta((out_features,), slices[:1], init="zeros"))
        self.fp8 = "none"  # train.fp8 recipe (tensor_parallel.fp8.convert_to_fp8)
        self.fp8_casts: Optional[fp8.Fp8Casts] = None  # the model's fp8 casting (its weight copies), ditto

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = enter_tp_region(x, self.group, self.sp)  # (b, s, in)
        y = fp8.linear(x, self.weight, self.bias, self.fp8, "column", self.group, self.fp8_casts,
                       self)  # (b, s, out/tp)
        return gather_from_tp(y, self.group, -1) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Input features split over TP; partial products summed on the way out.

        X_r (b, s, in/tp)   W = [W_0 | W_1 | ...] columns split    Y = sum_r X_r @ W_r^T
                            rank r holds W_r (out, in/tp)           all-reduce -> (b, s, out)
                                                                    or with sp reduce-scatter -> (b, s/tp, out)

    reduce=False returns the partial sum: for a caller that adds several partial sums and reduces once
    (the MoE layer reduces routed and shared experts together).
    """

    def __init__(self, in_features: int, out_features: int, group: Group, sequence_parallel: bool = False,
                 std: Optional[float] = None, reduce: bool = True) -> None:
        super().__init__()
        self.group, self.sp, self.reduce = group, sequence_parallel, reduce
        meta = ParamMeta((out_features, in_features),
                         shard_slices((out_features, in_features), 1, group.rank, group.size), std=std, matrix=True)
        self.weight = new_param((out_features, in_features // group.size), meta)
        self.fp8 = "none"
        self.fp8_casts: Optional[fp8.Fp8Casts] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8.linear(x, self.weight, None, self.fp8, "row", self.group, self.fp8_casts, self)  # (b, s, out) partial
        if not self.reduce:
            return y
        return reduce_scatter_to_sp(y, self.group) if self.sp else reduce_from_tp(y, self.group)


def check_kv_split(kv_heads: int, tp: int) -> None:
    """KV heads are split over TP (kv % tp == 0) or replicated with each rank using one (tp % kv == 0)."""
    if kv_heads % tp and tp % kv_heads:
        raise ValueError(f"model.num_kv_heads={kv_heads} and parallel.tp={tp}: one must divide the other (kv heads "
                         f"are split across tp ranks, or replicated when tp > num_kv_heads)")


class KVParallelLinear(nn.Module):
    """Key or value projection for grouped-query attention under TP.

    kv_heads % tp == 0: an ordinary column split, rank r holds kv_heads/tp heads.
    tp % kv_heads == 0 (more ranks than kv heads): every rank holds all kv heads (replicated) and computes
    only the head its query heads use: head r // (tp / kv_heads). Each rank then has a *partial* weight
    gradient (nonzero only on its head's rows); the gradients are summed over TP (meta.grad_reduce).

        kv=2, tp=4:   ranks 0,1 -> kv head 0     ranks 2,3 -> kv head 1
    """

    def __init__(self, in_features: int, kv_heads: int, head_dim: int, group: Group, std: Optional[float] = None,
                 bias: bool = False) -> None:
        super().__init__()
        tp = group.size
        shape = (kv_heads * head_dim, in_features)
        self.head_dim, self.group, self.fp8 = head_dim, group, "none"
        self.fp8_casts: Optional[fp8.Fp8Casts] = None
        if kv_heads % tp == 0:
            self.row_range = None
            meta = ParamMeta(shape, shard_slices(shape, 0, group.rank, tp), std=std, matrix=True)
            self.weight = new_param((shape[0] // tp, in_features), meta)
        elif tp % kv_heads == 0:
            head = group.rank // (tp // kv_heads)
            self.row_range = (head * head_dim, (head + 1) * head_dim)
            meta = ParamMeta(shape, full_slices(shape), std=std, grad_reduce=("tp",), replicated=("tp",),
                             matrix=True)
            self.weight = new_param(shape, meta)
        else:
            check_kv_split(kv_heads, tp)
        self.bias = None
        if bias:  # the bias follows the weight's rows: split, or replicated with a partial gradient
            w = self.weight.meta
            self.bias = new_param((self.weight.shape[0],), ParamMeta(shape[:1], w.slices[:1], init="zeros",
                                                                    grad_reduce=w.grad_reduce, replicated=w.replicated))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_range is None:  # (b, s, local_kv_heads * head_dim)
            return fp8.linear(x, self.weight, self.bias, self.fp8, "column", self.group, self.fp8_casts, self)
        lo, hi = self.row_range  # replicated heads: fp8 scales of this rank ("local")
        return fp8.linear(x, self.weight[lo:hi], None if self.bias is None else self.bias[lo:hi], self.fp8,
                          "local", self.group, self.fp8_casts, self)  # (b, s, head_dim)


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary (padded to a multiple of tp).

        table (V, h):  rank 0 rows [0, V/tp)  rank 1 rows [V/tp, 2V/tp) ...
        each rank looks up the ids it owns (others give 0), then all-reduce -> (b, s, h)
        (with sp: reduce-scatter along the sequence -> (b, s/tp, h))
    """

    def __init__(self, vocab_size: int, hidden: int, group: Group, sequence_parallel: bool = False,
                 std: Optional[float] = None) -> None:
        super().__init__()
        self.group, self.sp = group, sequence_parallel
        self.start, self.real_rows, local = vocab_shard(vocab_size, group.size, group.rank)
        meta = ParamMeta((vocab_size, hidden), (slice(self.start, self.start + self.real_rows), slice(0, hidden)),
                         std=std)
        self.weight = new_param((local, hidden), meta)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)  # (b, s, h)
        local = ids - self.start
        outside = (local < 0) | (local >= self.real_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # (b, s, h) partial
        out = out.masked_fill(outside[..., None], 0.0)
        return reduce_scatter_to_sp(out, self.group) if self.sp else reduce_from_tp(out, self.group)


class RMSNorm(nn.Module):
    """RMSNorm whose weight is replicated over TP. Under sp each rank sees s/tp of the sequence, so its
    weight gradient is partial and is summed over TP (meta.grad_reduce)."""

    def __init__(self, hidden: int, eps: float, group: Group, sequence_parallel: bool = False,
                 backend: str = "auto") -> None:
        super().__init__()
        self.eps, self.backend = eps, backend
        tp_sp = sequence_parallel and group.size > 1
        meta = ParamMeta((hidden,), full_slices((hidden,)), init="ones", grad_reduce=("tp",) if tp_sp else (),
                         replicated=("tp",) if group.size > 1 else ())
        self.weight = new_param((hidden,), meta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dispatch.rms_norm(x, self.weight, self.eps, self.backend)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(residual + x), residual + x) in one fused pass (Triton on CUDA, the torch twin elsewhere)."""
        return dispatch.rms_norm_residual(x, residual, self.weight, self.eps, self.backend)


def convert_to_fp8(model: torch.nn.Module, recipe: str, casts: Optional[fp8.Fp8Casts] = None) -> int:
    """Switch every column-, row- and KV-parallel linear of `model` to `recipe` (the LM head excepted), all
    sharing `casts` (default: a new fp8.Fp8Casts; the trainer opens it for each step, fp8.Fp8Casts);
    returns how many layers were switched."""
    casts = fp8.Fp8Casts() if casts is None else casts
    fp8.check_fp8(recipe, "bf16")
    param = next(model.parameters(), None)   # on the device the float8 GEMMs will run on
    if param is not None:
        fp8.check_fp8_device(recipe, param.device)
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, KVParallelLinear)) and name != "lm_head":
            module.fp8, module.fp8_casts = recipe, casts
            n += 1
            if getattr(module, "row_range", None) is None:  # the whole weight is the GEMM operand: ZeRO-3
                kind = "row" if isinstance(module, RowParallelLinear) else "column"  # may gather it in fp8
                module.weight.fp8 = fp8.Fp8Weight(recipe, kind, module.group)
    return n
