"""Training infrastructure: typed config (`config`) and its validation (`validate`), token data and sampler (`data`), LR schedule
(`lr_schedule`), throughput / MFU metrics (`metrics`) and the trainer loop.

Only the config API is re-exported here, so importing the package stays cheap; import the other
modules directly (e.g. `from parallel3d.training.data import TokenDataset`).
"""
from parallel3d.training.config import (CheckpointConfig, ConfigError, DataConfig, ExperimentConfig,
                                        LogConfig, ParallelConfig, TrainConfig, config_from_dict,
                                        load_config, save_yaml, to_dict)
from parallel3d.training.validate import resolve_and_validate

__all__ = ["CheckpointConfig", "ConfigError", "DataConfig", "ExperimentConfig", "LogConfig",
           "ParallelConfig", "TrainConfig", "config_from_dict", "load_config", "resolve_and_validate",
           "save_yaml", "to_dict"]
