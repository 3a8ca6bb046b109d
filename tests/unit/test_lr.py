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
