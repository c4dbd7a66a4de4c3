"""Data parallelism: gradient reduction (bucketed, overlapped), ZeRO-1/2/3, mixed precision.

    DistributedOptimizer    the trainer-facing object (optimizer.py)
    reduce_gradients        plain synchronous reference reduction (grads.py)
"""
from parallel3d.data_parallel.grads import reduce_gradients, reduction_groups
from parallel3d.data_parallel.optimizer import DistributedOptimizer
from parallel3d.data_parallel.precision import LossScaler

__all__ = ["DistributedOptimizer", "LossScaler", "reduce_gradients", "reduction_groups"]
