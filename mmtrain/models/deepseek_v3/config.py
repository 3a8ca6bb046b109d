"""The DeepSeek-V3 model family's shape and its YAML loader.

The dataclass, ``DeepseekV3Config``, lives in ``mmtrain.config.deepseek_v3_schema`` because a run config embeds
it (``model.family: deepseek_v3``, the shape under ``model.deepseek_v3``); it is re-exported here.
``load_deepseek_v3_config`` reads either a run config selecting this family (``configs/models/deepseek-v3-tiny.yaml``)
or a shape file holding a ``model:`` section of these fields; loading reuses ``mmtrain.config.loader``: unknown
keys and values of the wrong type are ``ConfigError``\\ s naming the key, and ``check`` then rejects impossible
combinations, naming the field.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from mmtrain.config.deepseek_v3_schema import DeepseekV3Config
from mmtrain.config.loader import load_config, read_yaml_with_includes

__all__ = ["DeepseekV3Config", "DeepseekV3ModelFile", "load_deepseek_v3_config"]


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
        from mmtrain.config.schema import GPTRunConfig

        nested = [o.replace("model.", "model.deepseek_v3.", 1) if o.startswith("model.") else o for o in overrides]
        run = load_config(GPTRunConfig, path, nested)
        return run.model.deepseek_v3.check(prefix="model.")
    return load_config(DeepseekV3ModelFile, path, overrides).model.check(prefix="model.")
