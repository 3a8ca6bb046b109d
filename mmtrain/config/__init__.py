"""Configuration: documented dataclasses, YAML overlay with includes, dotted overrides, validation."""

from mmtrain.config.loader import ConfigError, load_config, read_yaml_with_includes, save_config
from mmtrain.config.schema import (
    CheckpointConfig,
    DataConfig,
    GPTRunConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
)
from mmtrain.config.validate import validate_gpt_config

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "GPTRunConfig", "LoggingConfig", "ModelConfig",
    "OptimConfig", "ParallelConfig", "TrainConfig", "load_config", "read_yaml_with_includes", "save_config",
    "validate_gpt_config",
]
