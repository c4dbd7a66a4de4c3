"""train.recompute_layers: recompute granularity per pipeline chunk (Megatron's --recompute-method block).

In every model chunk the trainer builds, the first N transformer layers are recomputed whole in backward
(only their input is kept), the others follow train.activation_checkpointing (none: everything kept;
selective: the attention core recomputed). A chunk with fewer than N layers recomputes all of them. N
trades memory for compute layer by layer between `none`/`selective` and `full`, which is what fits a
model whose activations with selective recomputation everywhere just miss the device.

A model opts in with `set_recompute_layers(n)` on its chunks (the built-in Llama / MoE / DeepSeek models);
the trainer refuses the key for a model without it rather than ignoring it.
"""
from __future__ import annotations

from typing import Sequence

from torch import nn


def apply_recompute_layers(chunks: Sequence[nn.Module], n: int) -> None:
    """Tell every chunk to recompute its first `n` transformer layers whole (n = 0: nothing to do)."""
    if n == 0:
        return
    for chunk in chunks:
        setter = getattr(chunk, "set_recompute_layers", None)
        if setter is None:
            raise ValueError(f"train.recompute_layers={n} needs model chunks with set_recompute_layers(n) (the "
                             f"built-in models have it); {type(chunk).__name__} has none: set "
                             f"train.recompute_layers=0 or add the method")
        setter(n)
