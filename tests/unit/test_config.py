"""Config system: overlay order, includes, dotted overrides, strictness, cross-field checks, round trip."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from mmtrain.config import (ConfigError, GPTRunConfig, VLMRunConfig, load_config, save_config, validate_gpt_config,
                            validate_vlm_config)

REPO = Path(__file__).resolve().parents[2]


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_are_valid_with_mock_data():
    cfg = load_config(GPTRunConfig, None, ["data.mock=true"])
    validate_gpt_config(cfg, world_size=1)
    assert cfg.model.num_layers == 2 and cfg.data.mock is True


def test_overlay_order_defaults_file_overrides(tmp_path):
    f = _write(tmp_path / "run.yaml", "model:\n  num_layers: 4\n  hidden_size: 128\noptim:\n  lr: 1e-3\n")
    cfg = load_config(GPTRunConfig, f, ["model.num_layers=6"])
    assert cfg.model.num_layers == 6  # override beats file
    assert cfg.model.hidden_size == 128  # file beats default
    assert cfg.optim.lr == pytest.approx(1e-3)  # '1e-3' is a YAML string; accepted for a float field
    assert cfg.model.ffn_hidden_size == 176  # default kept


def test_include_and_inherit(tmp_path):
    (tmp_path / "base").mkdir()
    _write(tmp_path / "base" / "model.yaml", "model:\n  num_layers: 8\n  hidden_size: 256\n")
    _write(tmp_path / "base" / "train.yaml", "include: model.yaml\ntrain:\n  steps: 7\nmodel:\n  hidden_size: 512\n")
    child = _write(tmp_path / "child.yaml", "include: [base/train.yaml]\nmodel:\n  num_layers: 3\n")
    cfg = load_config(GPTRunConfig, child)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.train.steps) == (3, 512, 7)


def test_include_cycle_and_missing(tmp_path):
    _write(tmp_path / "a.yaml", "include: b.yaml\n")
    _write(tmp_path / "b.yaml", "include: a.yaml\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_config(GPTRunConfig, tmp_path / "a.yaml")
    _write(tmp_path / "c.yaml", "include: nope.yaml\n")
    with pytest.raises(ConfigError, match=r"config file not found: .*nope.yaml \(included from .*c.yaml\)"):
        load_config(GPTRunConfig, tmp_path / "c.yaml")


def test_unknown_key_suggests_closest(tmp_path):
    with pytest.raises(ConfigError, match=re.escape("unknown config key 'model.num_layer' in command-line override "
                                                    "'model.num_layer=3'; did you mean 'model.num_layers'?")):
        load_config(GPTRunConfig, None, ["model.num_layer=3"])
    f = _write(tmp_path / "x.yaml", "optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.learning_rate' in .*x.yaml; did you mean "
                                          r"'optim.lr'\?"):  # not the more alike 'optim.min_lr'
        load_config(GPTRunConfig, f)
    with pytest.raises(ConfigError, match=r"did you mean 'optim.min_lr'\?"):
        load_config(GPTRunConfig, None, ["optim.min_learning_rate=0"])
    with pytest.raises(ConfigError, match="unknown config key 'modle'.*did you mean 'model'"):
        load_config(GPTRunConfig, None, ["modle.num_layers=3"])


@pytest.mark.parametrize("override, message", [
    ("model.num_layers=abc", "config key 'model.num_layers' .*expected an integer, got 'abc'"),
    ("model.num_layers=2.5", "expected an integer, got 2.5"),
    ("data.mock=3", "config key 'data.mock' .*expected true or false, got 3"),
    ("model.norm=batchnorm", "expected one of 'rmsnorm', 'layernorm', got 'batchnorm'"),
    ("data.prefixes=5", "expected a list"),
    ("model=3", "config key 'model' .*is a section"),
    ("optim.lr", "not of the form key=value"),
])
def test_type_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(GPTRunConfig, None, [override])


def test_a_list_key_given_one_value_shows_the_list_syntax(tmp_path):
    with pytest.raises(ConfigError, match=re.escape(
            "config key 'data.prefixes' in command-line override 'data.prefixes=shards/web': expected a list, got "
            "'shards/web' (str); write it in brackets: data.prefixes=[shards/web] on the command line, prefixes: "
            "[shards/web] in a YAML file (several: [a, b])")):
        load_config(GPTRunConfig, None, ["data.prefixes=shards/web"])
    f = _write(tmp_path / "x.yaml", "data:\n  prefixes: shards/web\n")
    with pytest.raises(ConfigError, match=re.escape("prefixes: [shards/web] in a YAML file")):
        load_config(GPTRunConfig, f)


def test_override_values_are_parsed_as_yaml():
    cfg = load_config(GPTRunConfig, None, ["data.prefixes=[a, b]", "model.tie_embeddings=true", "optim.lr=2e-4"])
    assert cfg.data.prefixes == ["a", "b"] and cfg.model.tie_embeddings is True and cfg.optim.lr == 2e-4


@pytest.mark.parametrize("overrides, message", [
    (["model.num_attention_heads=3"], r"model.hidden_size \(64\) must be divisible by model.num_attention_heads \(3\)"),
    (["parallel.tp=8"], r"model.num_attention_heads \(4\) must be divisible by parallel.tp \(8\)"),
    (["model.num_query_groups=1", "parallel.tp=2"], r"model.num_query_groups \(1\) must be divisible by parallel.tp"),
    (["parallel.pp=4"], r"model.num_layers \(2\) must be >= parallel.pp"),
    (["parallel.sequence_parallel=true"], "sequence_parallel needs parallel.tp > 1"),
    (["data.mock=false"], "no training data"),
    (["parallel.cp=3"], r"data.seq_length \(128\) must be divisible by 2 \* parallel.cp"),
    (["data.num_workers=-1"], r"data.num_workers must be >= 0"),
])
def test_cross_field_checks(overrides, message):
    cfg = load_config(GPTRunConfig, None, ["data.mock=true", *overrides])
    with pytest.raises(ConfigError, match=message):
        validate_gpt_config(cfg)


def test_layout_checked_against_world_size():
    from mmtrain.parallel import LayoutError

    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "parallel.tp=2"])
    with pytest.raises(LayoutError, match="world size 3 is not divisible by tp"):
        validate_gpt_config(cfg, world_size=3)
    cfg = load_config(GPTRunConfig, None, ["data.mock=true", "train.global_batch_size=6"])
    with pytest.raises(ConfigError, match=r"global_batch_size \(6\) must be a multiple"):
        validate_gpt_config(cfg, world_size=4)
    cfg = load_config(VLMRunConfig, None, ["data.blend=media", "media.tokenizer=t.model", "media.slices=16",
                                           "model.image_token_id=500"])
    with pytest.raises(ConfigError, match=r"media.slices \(16\) must be a multiple of the data-parallel size \(3\)"):
        validate_vlm_config(cfg, world_size=3)


def test_resolved_config_round_trips(tmp_path):
    cfg = load_config(GPTRunConfig, None, ["model.num_layers=5", "data.prefixes=[x]"])
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert yaml.safe_load(path.read_text())["model"]["num_layers"] == 5
    assert load_config(GPTRunConfig, path) == cfg
    assert not list((tmp_path / "run").glob("*.tmp"))


def test_every_field_is_documented():
    import dataclasses

    def walk(cls):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help"), f"{cls.__name__}.{f.name} has no help text"
            if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
                walk(type(getattr(cls(), f.name)))

    walk(GPTRunConfig)


@pytest.mark.parametrize("path", sorted((REPO / "configs").rglob("*.yaml")), ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_loads(path):
    """Every YAML under configs/ loads; run configs (gpt/, models/) also pass the cross-field checks."""
    rel = path.relative_to(REPO / "configs")
    if rel.parts[0] in ("gpt", "models"):
        cfg = load_config(GPTRunConfig, path, ["data.mock=true"] if rel.parts[0] == "models" else [])
        validate_gpt_config(cfg)
    else:
        assert yaml.safe_load(path.read_text()) is not None


def test_config_reference_is_up_to_date():
    from mmtrain.config.reference import reference_markdown

    committed = (REPO / "docs" / "config-reference.md").read_text()
    assert committed == reference_markdown(), (
        "docs/config-reference.md is stale: run `python -m mmtrain.config.reference > docs/config-reference.md`")


def test_the_vlm_run_config_is_the_gpt_runs_sections_plus_its_own():
    import dataclasses
    import typing

    from mmtrain.config.schema import DataConfig, RunSections

    shared = typing.get_type_hints(RunSections)
    for root in (GPTRunConfig, VLMRunConfig):
        hints = typing.get_type_hints(root)
        assert all(hints[name] is cls for name, cls in shared.items())  # the same classes, declared once
    assert not [f.name for f in dataclasses.fields(DataConfig) if f.name.startswith("mm_")]  # media keys: VLM only
    with pytest.raises(ConfigError, match="unknown config key 'media'"):
        load_config(GPTRunConfig, None, ["media.tokenizer=t.model"])
    vlm = load_config(VLMRunConfig, None, ["model.language.num_layers=3", "data.seq_length=64"])
    lm_run = vlm.language_run()
    assert lm_run.model is vlm.model.language and lm_run.data is vlm.data and lm_run.train is vlm.train


def test_vlm_language_model_errors_name_the_real_key():
    cfg = load_config(VLMRunConfig, None, ["data.mock=true", "model.image_token_id=500", "parallel.tp=8"])
    with pytest.raises(ConfigError, match=r"^model.language.num_attention_heads \(4\) must be divisible by "
                                          r"parallel.tp \(8\)$"):
        validate_vlm_config(cfg)
