"""The DeepSeek-V3 family's shape read from a YAML file.

``load_deepseek_v3_config`` reads either a run config selecting this family (``configs/models/deepseek-v3-tiny.yaml``)
or a shape file holding a ``model:`` section of these fields; loading reuses ``mmtrain.config.loader``: unknown
keys and values of the wrong type are ``ConfigError``\\ s naming the key, and ``check`` then rejects impossible
combinations, naming the field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mmtrain.config.loader import load_config, read_yaml_with_includes
from mmtrain.config.schema import GPTRunConfig
from mmtrain.models.deepseek_v3.config import DeepseekV3Config


@dataclass
class DeepseekV3ModelFile:
    """What a DeepSeek-V3 shape file holds: one ``model:`` section."""

    model: DeepseekV3Config = field(default_factory=DeepseekV3Config, metadata={"help": "The model shape."})


def _is_run_config(path: str | os.PathLike) -> bool:
    model = (read_yaml_with_includes(path) or {}).get("model")
    return isinstance(model, dict) and "family" in model


def load_deepseek_v3_config(path: str | os.PathLike | None = None, overrides: list[str] = ()) -> DeepseekV3Config:
    """Defaults, then the file, then ``model.key=value`` overrides of the shape's fields; checked. The file is a
    run config (``model.family: deepseek_v3``: the shape is its ``model.deepseek_v3`` section; its other
    sections are not read here) or a shape file (a ``model:`` section of ``DeepseekV3Config`` fields)."""
    if path is not None and _is_run_config(path):
        nested = [o.replace("model.", "model.deepseek_v3.", 1) if o.startswith("model.") else o for o in overrides]
        run = load_config(GPTRunConfig, path, nested)
        return run.model.deepseek_v3.check(prefix="model.")
    return load_config(DeepseekV3ModelFile, path, overrides).model.check(prefix="model.")
