"""Configuration: documented dataclasses, YAML overlay with includes, dotted overrides, validation.

Public names load lazily: the model families' config modules (``mmtrain/models/<family>/config.py``) import
``mmtrain.config.fields`` and ``mmtrain.config.loader``, and the run schema loads those modules from the family
table, so importing this package must not import the schema.
"""

from mmtrain.utils.lazy import lazy_exports

_PUBLIC = {
    **dict.fromkeys(("ConfigError", "load_config", "read_yaml_with_includes", "save_config"), "mmtrain.config.loader"),
    "MediaConfig": "mmtrain.config.media_schema",
    **dict.fromkeys(("CheckpointConfig", "DataConfig", "Fp8Config", "GPTRunConfig", "LoggingConfig", "ModelConfig",
                     "OptimConfig", "ParallelConfig", "RunSections", "TrainConfig"), "mmtrain.config.schema"),
    "validate_gpt_config": "mmtrain.config.validate",
    "VLMRunConfig": "mmtrain.config.vlm_run_schema",
    **dict.fromkeys(("AudioConfig", "ProjectorConfig", "VisionConfig", "VLMModelConfig"), "mmtrain.config.vlm_schema"),
    "validate_vlm_config": "mmtrain.config.vlm_validate",
}
__all__ = [
    "AudioConfig", "CheckpointConfig", "ConfigError", "DataConfig", "Fp8Config", "GPTRunConfig", "LoggingConfig",
    "MediaConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "ProjectorConfig", "RunSections", "TrainConfig",
    "VLMModelConfig", "VLMRunConfig", "VisionConfig", "load_config", "read_yaml_with_includes", "save_config",
    "validate_gpt_config", "validate_vlm_config",
]
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC, globals())
