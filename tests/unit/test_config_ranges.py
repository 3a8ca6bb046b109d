"""Every numeric config field has a declared range, checked up front with an error naming the dotted key."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from mmtrain.config import ConfigError, GPTRunConfig, load_config, validate_gpt_config
from mmtrain.config.vlm_run_schema import VLMRunConfig
from mmtrain.config.vlm_validate import validate_vlm_config

FINITE_ONLY = {"media.image_mean"}  # any finite value is a valid mean


@pytest.mark.parametrize("override, message", [
    ("optim.lr=-1", "optim.lr must be > 0, got -1.0"),
    ("optim.lr=nan", "optim.lr must be a finite number (> 0), got nan"),
    ("optim.lr=.inf", "optim.lr must be a finite number (> 0), got inf"),
    ("optim.beta1=5", "optim.beta1 must be < 1, got 5.0"),
    ("optim.beta2=-0.1", "optim.beta2 must be >= 0, got -0.1"),
    ("train.steps=0", "train.steps must be >= 1, got 0"),
    ("checkpoint.save_every=-1", "checkpoint.save_every must be >= 0, got -1"),
    ("optim.warmup_steps=-5", "optim.warmup_steps must be >= 0, got -5"),
    ("optim.eps=0", "optim.eps must be > 0, got 0.0"),
    ("optim.decay_fraction=1.5", "optim.decay_fraction must be <= 1, got 1.5"),
    ("data.seed=-1", "data.seed must be >= 0, got -1"),
    ("data.seed=5000000000", "data.seed must be <= 2^32-1, got 5000000000"),
    ("parallel.pipeline_layers=[1, 0]", "parallel.pipeline_layers[1] must be >= 1, got 0"),
    ("parallel.collective_timeout_s=0", "parallel.collective_timeout_s must be > 0, got 0.0"),
    ("logging.log_every=0", "logging.log_every must be >= 1, got 0"),
    ("model.norm_eps=-1e-5", "model.norm_eps must be > 0, got -1e-05"),
    ("train.exit_at_step=30", "train.exit_at_step (30) is past train.steps (20)"),
    ("optim.min_lr=0.1", "optim.min_lr (0.1) must be <= optim.lr (0.0003)"),
])
def test_bad_numeric_value_names_the_key(override, message):
    cfg = load_config(GPTRunConfig, None, ["data.mock=true", override])
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_gpt_config(cfg)


@pytest.mark.parametrize("override, message", [
    ("model.vision.patch_size=0", "model.vision.patch_size must be >= 1, got 0"),
    ("model.audio.norm_eps=nan", "model.audio.norm_eps must be a finite number (> 0), got nan"),
    ("model.projector.pixel_shuffle=-2", "model.projector.pixel_shuffle must be >= 1, got -2"),
    ("model.language.hidden_size=0", "model.language.hidden_size must be >= 1, got 0"),
    ("lr_scale={vision: .nan}", "lr_scale.vision must be a finite number (> 0), got nan"),
    ("optim.beta1=5", "optim.beta1 must be < 1, got 5.0"),
    ("media.image_mean=[0.5, nan, 0.5]", "media.image_mean[1] must be a finite number, got nan"),
    ("media.slices=0", "media.slices must be >= 1, got 0"),
])
def test_vlm_numeric_values_name_their_keys(override, message):
    cfg = load_config(VLMRunConfig, None, ["data.mock=true", override])
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_vlm_config(cfg)


def _numeric_fields(cls: type, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], prefix + f.name
        if dataclasses.is_dataclass(tp):
            yield from _numeric_fields(tp, key + ".")
            continue
        args = typing.get_args(tp)
        leaf = args[-1] if typing.get_origin(tp) in (list, dict) else tp
        if leaf in (int, float):
            yield key, f


@pytest.mark.parametrize("root", [GPTRunConfig, VLMRunConfig])
def test_every_numeric_field_declares_its_range(root):
    missing = [key for key, f in _numeric_fields(root)
               if key not in FINITE_ONLY and not {"ge", "gt", "le", "lt"} & set(f.metadata)]
    assert not missing, f"numeric fields without a declared range (doc(..., ge=...)): {missing}"


@pytest.mark.parametrize("root", [GPTRunConfig, VLMRunConfig])
def test_every_default_is_in_range(root):
    from mmtrain.config.ranges import check_ranges

    check_ranges(root())
