"""Fused ops for the reference models: one op per file, each with Triton kernel(s), launch functions,
an autograd wrapper and a pure-torch reference. `kernels.dispatch` picks the implementation.
`attention_standin.py` holds the ops without a kernel: the planner's meta stand-ins for SDPA's on CUDA;
`attention_cuda.py` calls SDPA's own CUDA ops that return the lse (cuDNN's, FlashAttention-2's) for CP blocks.

This package never imports `parallel3d`, `models` or `launch` (docs/architecture.md section 1).
"""
