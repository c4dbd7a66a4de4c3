"""Fused ops for the reference models: one op per file, each with Triton kernel(s), launch functions,
an autograd wrapper and a pure-torch reference. `kernels.dispatch` picks the implementation.
`attention_standin.py` is the one op without a kernel: the planner's meta stand-in for SDPA's on CUDA.

This package never imports `parallel3d`, `models` or `launch` (docs/architecture.md section 1).
"""
