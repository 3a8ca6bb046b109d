"""A resume compares the checkpoint's schedule and data-order records with the run's: a change is one error
naming every changed key, unless checkpoint.schedule_change / data_order_change says what to do."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from mmtrain.config import GPTRunConfig, load_config
from mmtrain.train.checkpoint import CheckpointError
from mmtrain.train.lr import lr_at
from mmtrain.train.resume_inputs import resolve_resume, resume_records, schedule_of

MOCK = ["data.mock=true", "train.steps=40", "optim.lr=3e-3", "optim.warmup_steps=5"]


def _checkpoint(tmp_path, overrides, step=20, dp=1, records=True):
    """A checkpoint folder whose complete.json is what a run with ``overrides`` writes at ``step``."""
    cfg = load_config(GPTRunConfig, None, overrides)
    folder = tmp_path / f"step_{step:08d}"
    folder.mkdir()
    meta = {"step": step, "layout": {"dp": dp}, "config": dataclasses.asdict(cfg)}
    if records:
        meta |= resume_records(cfg, schedule_of(cfg), dp)
    (folder / "complete.json").write_text(json.dumps(meta))
    return folder


def _cfg(*overrides):
    return load_config(GPTRunConfig, None, list(overrides))


def test_same_inputs_resume_with_this_runs_schedule(tmp_path):
    found = _checkpoint(tmp_path, MOCK)
    assert resolve_resume(found, _cfg(*MOCK), 1) == schedule_of(_cfg(*MOCK))
    # the layout may change; the global batch size it implies may not
    assert resolve_resume(found, _cfg(*MOCK, "train.global_batch_size=2"), 2) == schedule_of(_cfg(*MOCK))


@pytest.mark.parametrize("records", [True, False], ids=["recorded", "older checkpoint: from its config"])
def test_a_changed_schedule_key_is_one_line_naming_it(tmp_path, records):
    found = _checkpoint(tmp_path, MOCK, records=records)
    with pytest.raises(CheckpointError) as err:
        resolve_resume(found, _cfg(*MOCK, "train.steps=60", "optim.lr=1e-3"), 1)
    msg = str(err.value)
    assert "\n" not in msg
    assert "train.steps: 40 in the checkpoint, 60 now" in msg and "optim.lr: 0.003 in the checkpoint, 0.001 now" in msg
    assert "checkpoint.schedule_change=use_config" in msg and "train.exit_at_step" in msg
    assert "data order" not in msg  # mock samples do not depend on the run length


def test_only_keys_the_schedule_uses_count(tmp_path):
    const = [*MOCK, "optim.schedule=constant"]
    found = _checkpoint(tmp_path, const)
    resolve_resume(found, _cfg(*const, "optim.min_lr=1e-5", "optim.decay_fraction=0.5", "train.steps=80"), 1)
    with pytest.raises(CheckpointError, match=re.escape("optim.schedule: 'constant' in the checkpoint, 'wsd' now")):
        resolve_resume(found, _cfg(*MOCK, "optim.schedule=wsd"), 1)


def test_schedule_overrides(tmp_path):
    found = _checkpoint(tmp_path, MOCK, step=20)
    longer = _cfg(*MOCK, "train.steps=60", "checkpoint.schedule_change=use_config")
    assert resolve_resume(found, longer, 1) == schedule_of(longer)
    kept = resolve_resume(found, _cfg(*MOCK, "train.steps=60", "checkpoint.schedule_change=use_checkpoint"), 1)
    assert kept.total_steps == 40 and kept.lr(21) == lr_at(21, 40, _cfg(*MOCK).optim)
    assert kept.lr(50) == kept.optim.min_lr  # past the checkpoint's schedule: its final learning rate


def test_a_changed_data_order_is_named_with_its_fix(tmp_path):
    found = _checkpoint(tmp_path, MOCK)
    with pytest.raises(CheckpointError) as err:
        resolve_resume(found, _cfg(*MOCK, "data.seed=7", "train.global_batch_size=8"), 1)
    msg = str(err.value)
    assert "the data order (data.seed: 1234 in the checkpoint, 7 now; train.global_batch_size: 2 in the " \
           "checkpoint, 8 now)" in msg and "checkpoint.data_order_change=use_config" in msg
    assert "schedule" not in msg.split(";")[0]
    resolve_resume(found, _cfg(*MOCK, "data.seed=7", "train.global_batch_size=8",
                               "checkpoint.data_order_change=use_config"), 1)


def test_real_data_run_length_changes_both(tmp_path):
    (tmp_path / "blend.yaml").write_text("datasets: [{path: a, weight: 1}]\n")
    data = ["data.mock=false", f"data.blend={tmp_path / 'blend.yaml'}", "train.steps=40"]
    found = _checkpoint(tmp_path, data)
    with pytest.raises(CheckpointError) as err:
        resolve_resume(found, _cfg(*data, "train.steps=60"), 1)
    msg = str(err.value)
    assert "the learning-rate schedule (train.steps: 40" in msg and "the data order (train.steps: 40" in msg
    assert "checkpoint.schedule_change=use_config" in msg and "checkpoint.data_order_change=use_config" in msg
    resolve_resume(found, _cfg(*data, "train.steps=60", "checkpoint.schedule_change=use_config",
                               "checkpoint.data_order_change=use_config"), 1)
    (tmp_path / "blend.yaml").write_text("datasets: [{path: a, weight: 1}, {path: b, weight: 1}]\n")
    with pytest.raises(CheckpointError, match=re.escape("data.blend (file content sha256): '")):
        resolve_resume(found, _cfg(*data), 1)


def _vlm_checkpoint(tmp_path, overrides, older: str = ""):
    """A VLM checkpoint; ``older``: as written before the media section ("records": data.mm_* record keys,
    "config": no records, a stored config with data.mm_* keys)."""
    from mmtrain.config.vlm_run_schema import VLMRunConfig

    cfg = load_config(VLMRunConfig, None, overrides)
    config, records = dataclasses.asdict(cfg), resume_records(cfg, schedule_of(cfg), 1)
    media = config.pop("media") if older else {}
    config["data"] |= {f"mm_{k}": v for k, v in media.items()}
    order = {k.replace("media.", "data.mm_") if older else k: v for k, v in records["data_order"].items()}
    meta = {"step": 20, "layout": {"dp": 1}, "config": config}
    if older != "config":
        meta |= {"schedule": records["schedule"], "data_order": order}
    (tmp_path / "step_00000020").mkdir()
    (tmp_path / "step_00000020" / "complete.json").write_text(json.dumps(meta))
    return tmp_path / "step_00000020"


@pytest.mark.parametrize("older", ["", "records", "config"])
def test_a_vlm_resume_checks_the_media_order_keys_also_of_older_checkpoints(tmp_path, older):
    from mmtrain.config.vlm_run_schema import VLMRunConfig

    found = _vlm_checkpoint(tmp_path, MOCK, older)
    resolve_resume(found, load_config(VLMRunConfig, None, MOCK), 1)  # nothing changed, whatever the key names
    with pytest.raises(CheckpointError, match=re.escape("media.slices: 16 in the checkpoint, 8 now")):
        resolve_resume(found, load_config(VLMRunConfig, None, [*MOCK, "media.slices=8"]), 1)


@pytest.mark.parametrize("records", [True, False])
def test_an_unset_min_lr_is_its_value_lr_over_10(tmp_path, records):
    """A checkpoint of a run that set min_lr = lr / 10 resumes under a config leaving it unset (the same
    schedule), and the other way round; the record holds the number."""
    explicit = [*MOCK, "optim.min_lr=3e-4"]
    found = _checkpoint(tmp_path, explicit, records=records)
    assert resolve_resume(found, _cfg(*MOCK), 1).lr(30) == pytest.approx(schedule_of(_cfg(*explicit)).lr(30), rel=1e-12)
    assert resume_records(_cfg(*MOCK), schedule_of(_cfg(*MOCK)), 1)["schedule"]["optim.min_lr"] == pytest.approx(3e-4)
    (tmp_path / "b").mkdir()
    unset = _checkpoint(tmp_path / "b", MOCK, records=records)
    resolve_resume(unset, _cfg(*explicit), 1)
    with pytest.raises(CheckpointError, match="optim.min_lr"):
        resolve_resume(unset, _cfg(*MOCK, "optim.min_lr=1e-5"), 1)
