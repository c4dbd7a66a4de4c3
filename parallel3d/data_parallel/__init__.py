"""Data parallelism: gradient reduction (bucketed, overlapped), ZeRO-1/2/3, mixed precision.

    DataParallelConfig      every option, typed and validated (config.py)
    attach                  ZeRO-3's parameter gathering (zero=3) + the optimizer over the chunks (attach.py)
    DistributedOptimizer    the trainer-facing object (optimizer.py)
    reduce_gradients        plain synchronous reference reduction (grads.py)
"""
from parallel3d.data_parallel.attach import attach, attach_zero3
from parallel3d.data_parallel.config import DataParallelConfig
from parallel3d.data_parallel.grads import reduce_gradients, reduction_groups
from parallel3d.data_parallel.optimizer import DistributedOptimizer
from parallel3d.data_parallel.precision import LossScaler

__all__ = ["DataParallelConfig", "DistributedOptimizer", "LossScaler", "attach", "attach_zero3",
           "reduce_gradients", "reduction_groups"]
