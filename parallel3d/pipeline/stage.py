"""What the pipeline runtime needs from a model chunk, and how a chunk's auxiliary objective joins backward.

The runtime knows no model: a chunk is any module with `pre`, `post` and `boundary_shape` whose forward
returns the activation for the next stage (or, with labels on the last stage, the summed token loss). A
chunk without the head may also return an auxiliary objective term (MoE balancing losses); the runtime
reports it with the loss and attaches it to the activation with AuxObjective, so any schedule's backward
(one pass, or input and weight passes) minimises it too.
"""
from __future__ import annotations

from typing import Protocol

import torch


class PipelineStage(Protocol):
    """What the runtime needs from a model chunk (any nn.Module with these)."""
    pre: bool   # holds the embedding: its forward reads token ids (b, s_local)
    post: bool  # holds the head: forward(x, position_ids, labels) returns the summed token loss

    def boundary_shape(self, batch: int, seq_local: int) -> tuple[int, ...]:
        """Shape of the activation this stage sends on: (b, s_local[/tp with SP], h)."""

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor,
                 labels: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The activation, or on a stage without the head, optionally (activation, aux): a scalar term of
        the objective in loss_sum units (MoE balancing losses) that the runtime reports and back-propagates
        (AuxObjective)."""


class AuxObjective(torch.autograd.Function):
    """Identity on a stage's output; in backward it also gives the stage's auxiliary objective term (e.g.
    MoE balancing losses, in loss_sum units) the gradient `scale` = d(objective)/d(loss_sum), so the term
    is minimised with the loss by any schedule's backward (full, or split into input and weight passes).

        forward:  y = x                 backward: dx = dy,  daux = scale
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None
