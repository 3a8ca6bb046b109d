"""Configuration: documented dataclasses, YAML overlay with includes, dotted overrides, validation."""

from mmtrain.config.loader import (
    ConfigError,
    load_config,
    read_yaml_with_includes,
    save_config,
)
from mmtrain.config.media_schema import MediaConfig
from mmtrain.config.schema import (
    CheckpointConfig,
    DataConfig,
    Fp8Config,
    GPTRunConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    RunSections,
    TrainConfig,
)
from mmtrain.config.validate import validate_gpt_config
from mmtrain.config.vlm_run_schema import VLMRunConfig
from mmtrain.config.vlm_schema import (
    AudioConfig,
    ProjectorConfig,
    VisionConfig,
    VLMModelConfig,
)
from mmtrain.config.vlm_validate import validate_vlm_config

__all__ = [
    "AudioConfig", "CheckpointConfig", "ConfigError", "DataConfig", "Fp8Config", "GPTRunConfig", "LoggingConfig",
    "MediaConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "ProjectorConfig", "RunSections", "TrainConfig",
    "VLMModelConfig", "VLMRunConfig", "VisionConfig", "load_config", "read_yaml_with_includes", "save_config",
    "validate_gpt_config", "validate_vlm_config",
]
