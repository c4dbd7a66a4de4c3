"""Context parallelism: the sequence split over `cp` ranks (load-balanced for causal attention)."""
from parallel3d.context_parallel.attention import context_parallel_attention

__all__ = ["context_parallel_attention"]
