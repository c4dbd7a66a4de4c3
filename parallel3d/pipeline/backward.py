"""Split one stage's backward into an input-gradient pass and a later weight-gradient pass (ZB-H1).

Zero-bubble schedules send the gradient w.r.t. a stage's input (what the previous stage waits for)
as early as possible and compute weight gradients later, in what would otherwise be bubble time.
Recomputing the whole backward for the weights would waste the split, so :func:`backward_input`
runs autograd once, only towards the stage input, and records the gradient flowing into every
"intermediate": a node on the input's path that also consumes a weight (for ``y = x @ W.T`` the
matmul node, which receives ``dy``). :func:`backward_weight` later restarts autograd from those
intermediates with the recorded gradients and ``inputs=params``, so it computes only the ``dW``
branches. Gradients land in ``param.grad`` through the normal AccumulateGrad path, so the
optimizer's post-accumulate-grad hooks fire exactly as with one ``backward()``.

The graph analysis follows ``torch.distributed.pipelining._backward`` (Qi et al. 2023). A stage whose
input needs no gradient (the first stage reads token ids) has nothing to split: its input pass is
empty and the weight pass is the whole backward.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.autograd.graph import GradientEdge, Node


def _node(t: torch.Tensor) -> Node:
    """The autograd node of ``t``: its grad_fn, or the AccumulateGrad node of a leaf."""
    if t.grad_fn is not None:
        return t.grad_fn
    return t.view_as(t).grad_fn.next_functions[0][0]  # leaves create their accumulator lazily


def _root(output: torch.Tensor | GradientEdge) -> Node:
    """The node an output's gradient enters: a tensor's grad_fn, or the node of its edge (the runtime
    keeps only the edge of a stage output it has sent, see ``runtime.py``)."""
    return output.node if isinstance(output, GradientEdge) else output.grad_fn


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """Reverse edges of the graph below ``root``: node -> nodes that pass it a gradient."""
    rev: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in rev:
                rev[nxt] = []
                queue.append(nxt)
            rev[nxt].append(node)
    return rev


def _closure(starts: Sequence[Node], rev: dict[Node, list[Node]], stop: set[Node]
             ) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from ``starts`` along reverse edges, not entering ``stop``; and the stop
    nodes that were hit."""
    seen, hit = set(starts), set()
    queue = deque(starts)
    while queue:
        for node in rev.get(queue.popleft(), ()):
            if node in seen:
                continue
            if node in stop:
                hit.add(node)
                continue
            seen.add(node)
            queue.append(node)
    return seen, hit


@dataclass
class _Group:
    """Parameters whose gradients start at the same intermediates (merged when they share one)."""
    params: list[torch.Tensor]
    nodes: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)  # grad_outputs seen by each node


@dataclass
class WeightWork:
    """What :func:`backward_weight` needs; holds the graph (activations) until it runs."""
    groups: list[_Group]
    rest: list[torch.Tensor]             # params reached by no intermediate: full backward
    output: torch.Tensor | GradientEdge | None = None   # kept only when ``rest`` needs the whole graph
    grad: torch.Tensor | None = None


def backward_input(output: torch.Tensor | GradientEdge, grad: torch.Tensor, inp: torch.Tensor | None,
                   params: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, WeightWork]:
    """Gradient of ``output`` (seeded with ``grad``) w.r.t. ``inp``; weight work for later.

    ``output`` is the stage output or its gradient edge; ``inp`` the stage input (a leaf requiring
    grad) or None. Nothing is written to any .grad.
    """
    params = [p for p in params if p.requires_grad]
    if inp is None or not inp.requires_grad:
        return None, WeightWork([], params, output, grad)
    rev = _consumers(_root(output))
    on_input_path, _ = _closure([_node(inp)], rev, set())
    by_node: dict[Node, _Group] = {}
    rest = []
    for p in params:
        acc = _node(p)
        if acc not in rev:
            continue  # unused by this stage: no gradient, as with a plain backward
        _, hit = _closure([acc], rev, on_input_path)
        if not hit:
            rest.append(p)
            continue
        merged = {id(g): g for g in (by_node.get(n) for n in hit) if g is not None}
        group = _Group([p], sorted(hit, key=id))
        for g in merged.values():  # params sharing an intermediate are differentiated together
            group.params += g.params
            group.nodes = sorted(set(group.nodes) | set(g.nodes), key=id)
        for n in group.nodes:
            by_node[n] = group
    groups = list({id(g): g for g in by_node.values()}.values())

    def capture(group: _Group, node: Node):
        def hook(grad_outputs: tuple) -> None:
            group.grads[node] = grad_outputs
        return hook

    handles = [n.register_prehook(capture(g, n)) for g in groups for n in g.nodes]
    try:
        (dinp,) = torch.autograd.grad(output, [inp], grad, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    keep = bool(rest)
    return dinp, WeightWork(groups, rest, output if keep else None, grad if keep else None)


def backward_weight(work: WeightWork) -> None:
    """Accumulate the weight gradients into ``param.grad`` (hooks fire); frees the graph.

    Each group is differentiated on its own (``autograd.grad`` from its intermediates to its params):
    one engine call over every group would also run the input-gradient GEMMs between intermediates (an
    earlier group's params lie below a later intermediate, so the engine must propagate dX to reach them),
    redoing most of the input pass. A group with several intermediates on one path pins each of them to
    the gradient recorded in the input pass, so nothing is counted twice. The results then enter the
    params' accumulators in *one* engine call (seeded at the AccumulateGrad nodes): a gradient consumer
    (the DistributedOptimizer's post-accumulate hooks and end-of-backward callback) sees one backward per
    microbatch, as with a plain ``backward()``.

        dW_g = d(loss)/dW_g  with the seeds  dL/d(out of N) = recorded(N)  for N in group g's intermediates
    """
    params, grads = [], []
    if work.rest:  # parameters off the input path: the whole backward from the output reaches them
        multi = bool(work.groups)   # the groups still need the graph below the output
        params += work.rest
        grads += _grad([work.output], [work.grad], work.rest, retain_graph=multi)
    for group in work.groups:
        edges, seeds = [], []
        for node in group.nodes:
            for i, g in enumerate(group.grads.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    seeds.append(g)
        if not edges:
            continue
        pinned = [n.register_prehook(lambda _, saved=group.grads[n]: saved)
                  for n in group.nodes if group.grads.get(n)] if len(group.nodes) > 1 else []
        try:
            params += group.params
            grads += _grad(edges, seeds, group.params, retain_graph=False)
        finally:
            for h in pinned:
                h.remove()
    keep = [(p, g) for p, g in zip(params, grads) if g is not None]
    if keep:  # one engine call through the accumulators: post-accumulate hooks and callbacks fire once
        torch.autograd.backward([GradientEdge(_node(p), 0) for p, _ in keep], [g for _, g in keep])
    work.groups.clear()
    work.output = work.grad = None


def _grad(outputs: list, seeds: list, params: list[torch.Tensor], retain_graph: bool) -> list:
    return list(torch.autograd.grad(outputs, params, seeds, retain_graph=retain_graph, allow_unused=True))
