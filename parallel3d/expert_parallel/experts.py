"""Routed experts as stacked SwiGLU weights, run as one grouped computation over the local experts.

Weights (global shapes; each rank holds experts [ep_r*E_local, (ep_r+1)*E_local) and, under expert tensor
parallelism (the `etp` group, mesh_spec.py), the ffn slice [etp_r*f/etp, (etp_r+1)*f/etp), column/row split
like the dense MLP's):

    gate_proj, up_proj   (E, f, h)   local (E_local, f/etp, h)
    down_proj            (E, h, f)   local (E_local, h, f/etp)

    E=4 f=8, ep=2 etp=2:   ep_r 0 etp_r 0: experts 0-1, ffn 0-3     ep_r 0 etp_r 1: experts 0-1, ffn 4-7
                           ep_r 1 etp_r 0: experts 2-3, ffn 0-3     ep_r 1 etp_r 1: experts 2-3, ffn 4-7

`meta.expert=True`: gradients are summed over expert-data-parallel ranks, not DP x CP; the slices are
disjoint over ep x etp, so no other group replicates them. With etp > 1 each rank returns a *partial* output
(its ffn slice): summed by the MoE layer's TP reduce when etp == tp without SP, else the experts run on the
rows of all etp ranks and sum them back to each rank's (sp_dispatch.TPRows).

Rows arrive sorted by local expert with host-side counts, so each expert's rows are one contiguous slice:
  "loop"       one pair of GEMMs per local expert on its slice (few experts per rank: cheap, exact)
  "padded"     rows scattered into (E_local, max_count, h), three batched matmuls, gathered back
  "grouped_mm" torch.nn.functional.grouped_mm (one call per projection; CPU and CUDA)
  "triton"     our Triton grouped GEMM (kernels.grouped_gemm; CUDA, or the interpreter on CPU)
"auto" (choose_impl): on CUDA grouped_mm for 16-bit weights with 16-byte aligned rows, else the Triton
kernel (the loop on the meta stand-in); on the CPU the loop (grouped_mm is no faster there and slower for
many small experts: benchmarks/experts.py, RESULTS.md).
"""
from __future__ import annotations

from functools import partial
from itertools import accumulate
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from parallel3d.kernels import dispatch as kernels
from parallel3d.comm import Group
from parallel3d.host_sync import upload
from parallel3d.params import ParamMeta, new_param

IMPLS = ("auto", "loop", "padded", "grouped_mm", "triton")


def _swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str) -> torch.Tensor:
    return kernels.swiglu(gate, up, backend)


def grouped_swiglu_loop(x: torch.Tensor, counts: Sequence[int], w_gate: torch.Tensor, w_up: torch.Tensor,
                        w_down: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """x (N, h) expert-major, counts (E_local,) -> (N, h): one GEMM per expert and projection
    (grouped_linear's loop)."""
    return _grouped_swiglu("loop", x, counts, w_gate, w_up, w_down, backend)


def grouped_swiglu_padded(x: torch.Tensor, counts: Sequence[int], w_gate: torch.Tensor, w_up: torch.Tensor,
                          w_down: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """Same as the loop with three batched matmuls over (E_local, max_count, .) padded rows."""
    num, cap = len(counts), max(counts) if len(counts) else 0
    counts_t = upload(torch.tensor(list(counts)), x.device)  # (E_local,) pinned, non-blocking
    starts = torch.cumsum(counts_t, 0) - counts_t  # (E_local,)
    expert = torch.repeat_interleave(torch.arange(num, device=x.device), counts_t, output_size=x.shape[0])  # (N,)
    slot = expert * cap + torch.arange(x.shape[0], device=x.device) - starts[expert]  # (N,) padded row
    padded = x.new_zeros(num * cap, x.shape[1]).index_copy(0, slot, x).view(num, cap, x.shape[1])  # (E_l, C, h)
    hid = _swiglu(torch.bmm(padded, w_gate.transpose(1, 2)), torch.bmm(padded, w_up.transpose(1, 2)),
                  backend)  # (E_l, C, f)
    out = torch.bmm(hid, w_down.transpose(1, 2))  # (E_l, C, h)
    return out.reshape(num * cap, w_down.shape[1])[slot]  # (N, h)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a contiguous gradient: torch's CPU grouped_mm backward rejects the
    expanded (stride 0) gradients that e.g. a sum() produces."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g.contiguous()


def offsets(counts: Sequence[int], device: torch.device) -> torch.Tensor:
    """grouped_mm's offs, the cumulative row counts (E_local,) int32, uploaded without a host sync."""
    return upload(torch.tensor(list(accumulate(counts)), dtype=torch.int32), device)


def _grouped_swiglu(impl: str, x: torch.Tensor, counts: Sequence[int], w_gate: torch.Tensor, w_up: torch.Tensor,
                    w_down: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """The three projections of grouped_linear around the SwiGLU, the offsets uploaded once."""
    offs = offsets(counts, x.device) if impl == "grouped_mm" else None
    gate = grouped_linear(impl, x, counts, w_gate, offs=offs)  # (N, f)
    up = grouped_linear(impl, x, counts, w_up, offs=offs)  # (N, f)
    return grouped_linear(impl, _swiglu(gate, up, backend), counts, w_down, offs=offs)  # (N, h)


IMPL_FNS = {"loop": grouped_swiglu_loop, "padded": grouped_swiglu_padded,
            "grouped_mm": partial(_grouped_swiglu, "grouped_mm"), "triton": partial(_grouped_swiglu, "triton")}


def grouped_linear(impl: str, x: torch.Tensor, counts: Sequence[int], w: torch.Tensor, transposed: bool = False,
                   offs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One projection of the grouped experts, differentiable: x (N, in) sorted by expert, w (E_local, out, in)
    -> (N, out), expert e's rows times w[e]^T. transposed: w (E_local, in, out) and x_e @ w[e] (a projection's
    input gradient). `impl` resolved (choose_impl); "padded" runs the loop. The loop unbinds the weights once:
    indexing w[e] per expert would make backward materialise E full-size gradients (one per select); every
    expert runs, even on 0 rows, so every weight gets a (zero) gradient. `offs`: offsets(counts), if at hand."""
    if impl == "grouped_mm":
        offs = offsets(counts, x.device) if offs is None else offs  # (E_local,)
        return _ContiguousGrad.apply(F.grouped_mm(x, w if transposed else w.transpose(1, 2), offs=offs))
    if impl == "triton":
        from parallel3d.kernels.ops import grouped_mm_op
        return grouped_mm_op(x, w, [int(c) for c in counts], not transposed)  # (N, out)
    outs = [xe @ we if transposed else F.linear(xe, we) for xe, we in zip(x.split(list(counts)), w.unbind(0))]
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[2 if transposed else 1])


def grouped_weight_grad(impl: str, dy: torch.Tensor, x: torch.Tensor, counts: Sequence[int],
                        offs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dW (E_local, out, in) of grouped_linear: dW[e] = dy_e^T @ x_e over expert e's rows (zero for none)."""
    dy = dy.contiguous()
    if impl == "grouped_mm":
        offs = offsets(counts, x.device) if offs is None else offs  # (E_local,)
        return F.grouped_mm(dy.t(), x, offs=offs)  # (E_local, out, in)
    if impl == "triton":
        from parallel3d.kernels.ops import grouped_mm_wgrad
        return grouped_mm_wgrad(dy, x.contiguous(), [int(c) for c in counts])
    return torch.stack([dye.t() @ xe for dye, xe in zip(dy.split(list(counts)), x.split(list(counts)))])


def choose_impl(impl: str, x: torch.Tensor, hidden: int, ffn_local: int) -> str:
    """The implementation `impl` ("auto" resolved for x's device, dtype and the GEMM shapes)."""
    if impl != "auto":
        return impl
    if x.dtype == torch.float64 or not hasattr(F, "grouped_mm"):
        return "loop"
    if x.is_cuda or x.device.type == "meta":  # meta: the dry run's stand-in for CUDA
        aligned = hidden % 8 == 0 and ffn_local % 8 == 0  # grouped_mm wants 16-byte aligned rows
        if x.dtype in (torch.bfloat16, torch.float16) and aligned:  # (and bf16: CUDA's and meta's rule)
            return "grouped_mm"
        return "triton" if x.is_cuda else "loop"
    return "loop"


def grouped_swiglu(impl: str, x: torch.Tensor, counts: Sequence[int], w_gate: torch.Tensor, w_up: torch.Tensor,
                   w_down: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """SwiGLU experts on rows sorted by expert with implementation `impl` (see the module docstring)."""
    fn = IMPL_FNS[choose_impl(impl, x, w_gate.shape[2], w_gate.shape[1])]
    return fn(x, counts, w_gate, w_up, w_down, backend)


def per_expert_reference(x: torch.Tensor, expert: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
                         w_down: torch.Tensor) -> torch.Tensor:
    """Reference for tests and benchmarks: rows in any order, `expert` (N,) local expert id per row;
    a masked gather/scatter per expert (how Hugging Face's Mixtral runs its experts)."""
    out = torch.zeros_like(x)
    for e in range(w_gate.shape[0]):
        rows = torch.nonzero(expert == e).flatten()  # (n_e,)
        xe = x[rows]
        out = out.index_add(0, rows, F.linear(F.silu(F.linear(xe, w_gate[e])) * F.linear(xe, w_up[e]), w_down[e]))
    return out


def check_expert_split(num_experts: int, ffn_hidden: int, ep: int, etp: int) -> None:
    """Experts are split over EP, each expert's ffn dimension over ETP."""
    if num_experts % ep:
        raise ValueError(f"model.num_experts={num_experts} is not divisible by parallel.ep={ep}")
    if ffn_hidden % etp:
        raise ValueError(f"model.moe_ffn_hidden_size={ffn_hidden} (the expert ffn) is not divisible by "
                         f"parallel.etp={etp}")


def experts_replicated_over_tp(tp: int, ep: int, etp: int, num_experts: int, expert_ffn: int) -> Optional[str]:
    """The warning for experts held whole on several ranks of one TP group, or None. The fold (mesh_spec.py)
    gives a stage's consecutive ranks distinct expert slices in runs of ep*etp, so below tp the TP ranks hold
    copies: tp/(ep*etp) times the expert weights, and the MoE layer's activations grow with them
    (tests/test_tp_region.py measures 1.64x / 3.28x its 1/tp share at etp=1 ep=1, tp 2 / 4)."""
    if not num_experts or tp <= 1 or ep * etp >= tp:
        return None
    better = []
    if tp % etp == 0 and num_experts % (tp // etp) == 0:
        better.append(f"parallel.ep={tp // etp} (EP folded over the TP ranks)")
    if expert_ffn % tp == 0:
        better.append(f"parallel.etp={tp} (each expert split like the MLP)")
    return (f"parallel.ep={ep} parallel.etp={etp} at parallel.tp={tp}: the {tp} ranks of a TP group hold only "
            f"{ep * etp} distinct expert slice(s): each holds {tp / (ep * etp):g}x the expert weights a fold over "
            f"TP leaves it, and the MoE layer's activations grow with them; "
            + (f"set {' or '.join(better)}" if better else "fold EP over the TP ranks"))


class GroupedExperts(nn.Module):
    """This rank's E_local experts (of E), ffn dimension split over the etp group."""

    def __init__(self, num_experts: int, hidden: int, ffn_hidden: int, ep: Group, etp: Group, impl: str = "auto",
                 backend: str = "auto", std: Optional[float] = None) -> None:
        super().__init__()
        check_expert_split(num_experts, ffn_hidden, ep.size, etp.size)
        if impl not in IMPLS:
            raise ValueError(f"grouped expert implementation must be one of {IMPLS}, got {impl!r}")
        self.num_experts, self.local_experts = num_experts, num_experts // ep.size
        self.impl, self.backend = impl, backend
        e0, f_l = ep.rank * self.local_experts, ffn_hidden // etp.size
        f0 = etp.rank * f_l
        experts = slice(e0, e0 + self.local_experts)
        in_meta = dict(global_shape=(num_experts, ffn_hidden, hidden),
                       slices=(experts, slice(f0, f0 + f_l), slice(0, hidden)), std=std, expert=True,
                       matrix=True)
        self.gate_proj = new_param((self.local_experts, f_l, hidden), ParamMeta(**in_meta))
        self.up_proj = new_param((self.local_experts, f_l, hidden), ParamMeta(**in_meta))
        self.down_proj = new_param((self.local_experts, hidden, f_l), ParamMeta(
            (num_experts, hidden, ffn_hidden), (experts, slice(0, hidden), slice(f0, f0 + f_l)), std=std,
            expert=True, matrix=True))

    def forward(self, x: torch.Tensor, counts: Sequence[int], tp_rows=None, dispatched=None) -> torch.Tensor:
        """x (N, h) rows sorted by local expert, counts (E_local,) host ints -> (N, h) (partial over etp).
        tp_rows (sp_dispatch.TPRows): x is this rank's received rows, run together with the other etp ranks'
        -> (N, h) whole. dispatched(x, (w_gate, w_up, w_down), impl, backend): x is this rank's rows to
        *send*, and that runs the dispatch all-to-all in one node with the experts (delayed_wgrad.py) ->
        (N_recv, h). Every way through this module's forward, so the forward hooks that wait for the
        weights' buckets (offload/publish.py) see the read."""
        if dispatched is not None:
            return dispatched(x, (self.gate_proj, self.up_proj, self.down_proj), self.impl, self.backend)
        if len(counts) != self.local_experts or sum(counts) != x.shape[0]:
            raise ValueError(f"expert counts {list(counts)} do not match {x.shape[0]} rows for "
                             f"{self.local_experts} local experts")
        if tp_rows is not None:
            return tp_rows.run(self, x)
        return grouped_swiglu(self.impl, x, counts, self.gate_proj, self.up_proj, self.down_proj, self.backend)
