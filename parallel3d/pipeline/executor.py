"""One rank's executor of a pipeline plan (``runtime.py`` builds the plan and runs it here): each compute
action (forward, backward, its input and weight halves) and the slots that carry a microbatch's activations
between them.

Each (microbatch, chunk) keeps its received input (a leaf that collects the input gradient) and the
gradient edge of its output (the graph, i.e. the activations) in a slot from its forward until its
backward (or, for zero-bubble schedules, its weight pass) is done; then the slot is dropped. The
output tensor itself is not kept: once sent its storage is freed (Megatron's output deallocation),
and backward seeds the edge with the received gradient. The number of slots alive at once is the
activation memory the schedule promises (``PipelineStats.peak_live``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn
from torch.autograd.graph import GradientEdge

from parallel3d.host_sync import read_float
from parallel3d.interleave import BACKWARD, FORWARD
from parallel3d.mesh import ParallelContext

from .backward import WeightWork, backward_input, backward_weight
from .mailbox import Mailboxes
from .placement import stage_of
from .runtime_schedules import Pair, Post, Step
from .schedules import Action, ActionKind
from .stage import AuxObjective  # the stage contract a chunk meets: stage.PipelineStage

K = ActionKind
Record = list[tuple[int, Action, float, float]]  # (pp rank, action, start, end), time.perf_counter() times


@dataclass
class PipelineStats:
    """Filled in by the runs it is passed to (counts add up, the peak is the largest seen).

    ``peak_live``: most (microbatch, chunk) activations this rank held at once, from a forward
    until its backward (or, when backward is split, its weight pass) released them. ``trace``, when
    a list, gets ``("post", action)`` as each message is posted, ``("wait", action)`` as a receive
    is waited and ``("run", action)`` before each compute, in the order they happen."""
    peak_live: int = 0
    forwards: int = 0
    backwards: int = 0   # B and I actions
    messages: int = 0
    trace: list | None = None


@dataclass
class _Slot:
    """Everything one (microbatch, chunk) keeps between its forward and its last backward."""
    input: torch.Tensor | None   # received activation (leaf requiring grad); None on stage 0
    # loss_sum * loss_scale on the last stage; elsewhere the output's gradient edge (the output
    # itself is freed once sent)
    output: torch.Tensor | GradientEdge
    weight: WeightWork | None = None


@dataclass
class Executor:
    """Runs one rank's plan (``runtime_schedules.rank_plan``). Mailboxes are keyed by (microbatch,
    local chunk); an inbox holds a tensor, or a posted receive (``Incoming``) its reader waits for."""
    ctx: ParallelContext
    chunks: Sequence[nn.Module]
    mbs: Sequence[dict]
    loss_scale: float = 1.0
    backward: Callable[[torch.Tensor], None] | None = None
    before_backward: Callable[[int, int], None] | None = None
    record: Record | None = None
    stats: PipelineStats = field(default_factory=PipelineStats)
    train: bool = True
    lazy_sends: bool = True
    placement: str = "loop"   # which rank holds which stage (placement.py)

    def __post_init__(self) -> None:
        self.p, self.v, self.rank = self.ctx.spec.pp, len(self.chunks), self.ctx.coords.pp
        self.last = self.p * self.v - 1
        self.stages = [stage_of(self.rank, c, self.p, self.placement) for c in range(self.v)]
        self.params = [list(c.parameters()) for c in self.chunks]
        self.mail = Mailboxes(self.ctx, self.chunks, self.mbs, self.placement, self.lazy_sends,
                              self.record, self.stats.trace, self.clock)
        self.slots: dict[tuple[int, int], _Slot] = {}
        self.total = torch.zeros((), dtype=torch.float32, device=self.ctx.device)
        self._objective_scale: float | None = None
        self.dispatch = {K.FORWARD: self.forward, K.BACKWARD: self.backward_full,
                         K.BACKWARD_INPUT: self.backward_input, K.BACKWARD_WEIGHT: self.backward_weight}

    def clock(self) -> float:
        """Wall time for ``record``; on a GPU the queue is drained first so that it is real."""
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize(self.ctx.device)
        return time.perf_counter()

    def run(self, plan: Sequence[Step]) -> torch.Tensor:
        mail, timed, trace = self.mail, self.record is not None, self.stats.trace
        for step in plan:
            start = self.clock() if timed else 0.0
            if type(step) is Post:
                waited = mail.communicate(step.ops)
                if timed:
                    end = self.clock()
                    self.record += [(self.rank, a, start, end) for a in step.ops if waited or a.kind.is_send]
            elif type(step) is Pair:
                self.pair(step, start)
            else:
                if trace is not None:
                    trace.append(("run", step))
                mail.resumed = start
                self.dispatch[step.kind](step)
                if timed:  # the compute starts once its inputs are here (mail.take records the wait)
                    self.record.append((self.rank, step, mail.resumed, self.clock()))
        leftovers = mail.finish() + (["saved activations"] if self.slots else [])
        self.stats.messages += mail.messages
        if leftovers:
            raise RuntimeError(f"pipeline rank {self.rank}: schedule ended with unconsumed "
                               f"{', '.join(leftovers)} (a schedule/runtime mismatch)")
        return self.total

    # ------------------------------------------------------------------ compute
    def forward(self, a: Action) -> None:
        mb, c = a.microbatch, a.chunk
        stage, batch = self.stages[c], self.mbs[mb]
        x = batch["ids"] if stage == 0 else self.mail.take(self.mail.inbox_act, (mb, c))
        if stage > 0 and self.train:
            x.requires_grad_()  # a leaf: its .grad is the gradient to send back
        labels = batch["labels"] if stage == self.last else None
        docs = batch.get("documents")  # packed-document ids, only when masking (older chunks lack the kwarg)
        out = self.chunks[c](x, batch["position_ids"], labels, **({} if docs is None else {"documents": docs}))
        aux = None
        if isinstance(out, tuple):  # (activation, auxiliary objective term): see PipelineStage
            out, aux = out
        self.stats.forwards += 1
        if stage == self.last:
            out = out * self.loss_scale if self.train else out
            self.total += out.detach().float()
        else:
            shape, dtype = self.mail.shape(mb, c), self.mail.dtypes[c]
            if out.shape != shape or out.dtype != dtype:  # the peer would misread the bytes
                raise RuntimeError(f"pipeline stage {stage} produced {tuple(out.shape)} {out.dtype}"
                                   f" but stages exchange {shape} {dtype} (b, s_local, h)")
            self.mail.hand_over(out.detach().contiguous(), mb, c, forward=True)  # (b, s_local, h)
        if not self.train:
            return
        if aux is not None:  # part of the objective: reported, and its gradient joins the backward
            self.total += aux.detach().float() * self.loss_scale
            out = AuxObjective.apply(out, aux, self.objective_scale())
        if stage != self.last and out.grad_fn is not None:
            # Keep only the edge into the graph, not the output: once sent (or handed to the next
            # local chunk) its storage is freed unless the graph itself saved it (Megatron's output
            # deallocation). Backward seeds the edge; its shape is checked against the node's record.
            out = GradientEdge(out.grad_fn, out.output_nr)
        self.slots[(mb, c)] = _Slot(x if stage > 0 else None, out)
        self.stats.peak_live = max(self.stats.peak_live, len(self.slots))

    def pair(self, step: Pair, start: float) -> None:
        """A backward and a forward of two microbatches in turns (interleave.py): each hands the turn over
        after starting an expert all-to-all, so it travels while the other computes. Recorded as the
        turns each ran (several rows per action; their sum is its busy time, the pair's span is less than
        the sum of the two actions run apart when the all-to-alls hide)."""
        fwd, bwd = (step.first, step.second) if step.first.kind is K.FORWARD else (step.second, step.first)
        trace, timed = self.stats.trace, self.record is not None
        if trace is not None:
            trace.append(("run", step.first))
            trace.append(("run", step.second))
        self.mail.resumed = start
        turns: list | None = [] if timed else None
        first = FORWARD if step.first is fwd else BACKWARD
        run = {fwd: lambda: self.dispatch[fwd.kind](fwd), bwd: lambda: self.dispatch[bwd.kind](bwd)}
        if step.posts:  # the first's outputs leave as soon as it is done, during its partner's last turns
            compute = run[step.first]
            run[step.first] = lambda: (compute(), self._post(step.posts))
        self.ctx.interleave.run(run[fwd], run[bwd], first=first, turns=turns)
        if timed:
            end = self.clock()
            walls = [w for w, _ in turns] + [end]
            for (wall, side), until in zip(turns, walls[1:]):
                if until > wall:
                    self.record.append((self.rank, fwd if side == FORWARD else bwd, wall, until))

    def _post(self, ops: tuple) -> None:
        start = self.clock() if self.record is not None else 0.0
        waited = self.mail.communicate(ops)
        if self.record is not None:
            end = self.clock()
            self.record += [(self.rank, a, start, end) for a in ops if waited or a.kind.is_send]

    def objective_scale(self) -> float:
        """d(what backward minimises)/d(loss_sum): loss_scale times what the caller's backward multiplies a
        loss by (e.g. the fp16 loss scale), found once per step through the (linear) callback."""
        if self._objective_scale is None:
            probe = torch.ones((), device=self.ctx.device, requires_grad=True)
            self.backward(probe)
            if probe.grad is None:
                raise RuntimeError("the backward callback did not backpropagate its loss argument")
            self._objective_scale = read_float(probe.grad, self.ctx.stats.syncs, "step", nominal=1.0) * self.loss_scale
        return self._objective_scale

    def _seed(self, a: Action, slot: _Slot) -> torch.Tensor:
        """Gradient of what is minimised w.r.t. this chunk's output: the received output grad, or
        on the last stage d(backward's objective)/d(loss), found by letting the caller's callback
        backpropagate through a detached copy (loss scaling is linear)."""
        if self.stages[a.chunk] != self.last:
            return self.mail.take(self.mail.inbox_grad, (a.microbatch, a.chunk))
        probe = slot.output.detach().requires_grad_()
        self.backward(probe)
        if probe.grad is None:
            raise RuntimeError("the backward callback did not backpropagate its loss argument")
        return probe.grad

    def _send_input_grad(self, a: Action, slot: _Slot, grad: torch.Tensor | None) -> None:
        if slot.input is not None:
            if grad is None:  # the chunk ignored its input: the gradient is zero
                grad = torch.zeros_like(slot.input)
            self.mail.hand_over(grad.contiguous(), a.microbatch, a.chunk, forward=False)
        slot.input = None

    def backward_full(self, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        slot = self.slots.pop(key)
        if self.before_backward is not None:
            self.before_backward(*key)
        if self.stages[a.chunk] == self.last:
            self.backward(slot.output)
        else:
            torch.autograd.backward(slot.output, self.mail.take(self.mail.inbox_grad, key))
        self.stats.backwards += 1
        self._send_input_grad(a, slot, None if slot.input is None else slot.input.grad)

    def backward_input(self, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        slot = self.slots[key]
        if self.before_backward is not None:
            self.before_backward(*key)
        seed = self._seed(a, slot)
        grad, slot.weight = backward_input(slot.output, seed, slot.input, self.params[a.chunk])
        self.stats.backwards += 1
        slot.output = None  # the weight work holds what W needs
        self._send_input_grad(a, slot, grad)

    def backward_weight(self, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        slot = self.slots.pop(key)
        if self.before_backward is not None:
            self.before_backward(*key)
        backward_weight(slot.weight)
