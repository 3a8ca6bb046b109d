from __future__ import annotations

import pytest

from mmtrain.config.schema import OptimConfig
from mmtrain.train.lr import lr_at


def test_warmup_then_cosine_to_min():
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, schedule="cosine")
    assert lr_at(5, 100, cfg) == pytest.approx(0.5)
    assert lr_at(10, 100, cfg) == pytest.approx(1.0)
    assert lr_at(100, 100, cfg) == pytest.approx(0.1)
    assert lr_at(55, 100, cfg) == pytest.approx(0.55)


def test_wsd_holds_then_decays():
    cfg = OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=0, schedule="wsd", decay_fraction=0.2)
    assert lr_at(50, 100, cfg) == pytest.approx(1.0)
    assert lr_at(80, 100, cfg) == pytest.approx(1.0)
    assert lr_at(90, 100, cfg) == pytest.approx(0.5)
    assert lr_at(100, 100, cfg) == pytest.approx(0.0)


def test_constant():
    assert lr_at(70, 100, OptimConfig(lr=0.3, warmup_steps=0, schedule="constant")) == 0.3


def test_unset_min_lr_is_a_tenth_of_lr():
    """Setting only optim.lr (a DPO run's 5e-7) keeps the decay's end below it: lr / 10, not a fixed 3e-5."""
    from mmtrain.config import GPTRunConfig, load_config
    from mmtrain.config.validate import validate_gpt_config

    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "optim.lr=5e-7"])
    validate_gpt_config(cfg)  # was: optim.min_lr (3e-05) must be <= optim.lr (5e-07)
    assert cfg.optim.min_lr is None and cfg.optim.final_lr() == pytest.approx(5e-8)
    assert lr_at(cfg.train.steps, cfg.train.steps, cfg.optim) == pytest.approx(5e-8)
    default = OptimConfig()
    assert default.final_lr() == pytest.approx(3e-5)  # the default run's schedule is unchanged
    assert OptimConfig(lr=1.0, min_lr=0.0).final_lr() == 0.0  # an explicit value is kept, 0 included
