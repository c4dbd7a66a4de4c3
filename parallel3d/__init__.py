"""parallel3d: Megatron-style TP x PP x DP x CP x EP parallelism for transformer pretraining."""
