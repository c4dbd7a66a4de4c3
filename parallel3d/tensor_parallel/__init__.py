"""Tensor parallelism (Megatron) with sequence parallelism: region mappings, layers, vocab-parallel loss."""
from parallel3d.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel3d.tensor_parallel.layers import (ColumnParallelLinear, KVParallelLinear, RMSNorm,
                                               RowParallelLinear, VocabParallelEmbedding, enter_tp_region)
from parallel3d.tensor_parallel.mappings import (copy_to_tp, gather_from_sp, gather_from_tp, reduce_from_tp,
                                                 reduce_scatter_to_sp, scatter_to_sp, scatter_to_tp)
from parallel3d.tensor_parallel.region import column_entry

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "KVParallelLinear", "VocabParallelEmbedding", "RMSNorm",
           "enter_tp_region", "vocab_parallel_cross_entropy", "copy_to_tp", "reduce_from_tp", "scatter_to_tp",
           "gather_from_tp", "gather_from_sp", "reduce_scatter_to_sp", "scatter_to_sp", "column_entry"]
