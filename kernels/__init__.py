"""Fused ops for the reference models: one op per file, each with Triton kernel(s), launch functions,
an autograd wrapper and a pure-torch reference. `kernels.dispatch` picks the implementation.

This package never imports `parallel3d`, `models` or `launch` (docs/architecture.md section 1).
"""
