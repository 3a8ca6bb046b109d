"""``model.family`` selects the model family of a run; each family's shape is checked, a shape set for the other
family is an error naming the key (never silently ignored), and the registry builds the chosen family."""

from __future__ import annotations

from pathlib import Path

import pytest

from mmtrain.config import ConfigError, GPTRunConfig, VLMRunConfig, load_config, validate_gpt_config, validate_vlm_config
from mmtrain.models.families import FAMILY_PACKAGES

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "models" / "deepseek-v3-tiny.yaml"


def _check(path, overrides, world_size=None):
    validate_gpt_config(load_config(GPTRunConfig, path, ["data.mock=true", *overrides]), world_size)


def test_the_shipped_deepseek_config_selects_the_family_and_its_shape():
    cfg = load_config(GPTRunConfig, TINY, ["data.mock=true"])
    validate_gpt_config(cfg)
    assert cfg.model.family == "deepseek_v3" and cfg.model.shape() is cfg.model.deepseek_v3
    assert cfg.model.shape().name == "deepseek-v3-tiny" and cfg.model.shape().num_layers == 3
    assert load_config(GPTRunConfig, None, []).model.shape().name == "tiny"  # llama: the section itself


@pytest.mark.parametrize("path,overrides,match", [
    (TINY, ["model.hidden_size=128"], r"model\.hidden_size=128 belongs to model family llama but "
                                      r"model\.family=deepseek_v3 ignores it; set the shape under model\.deepseek_v3"),
    (None, ["model.deepseek_v3.n_group=2"], r"model\.deepseek_v3\.n_group=2 belongs to model family deepseek_v3 "
                                            r"but model\.family=llama ignores it"),
    (TINY, ["model.deepseek_v3.n_group=3"], r"model\.deepseek_v3\.n_group=3: must divide"),
    (TINY, ["model.deepseek_v3.rms_norm_eps=2"], r"model\.deepseek_v3\.rms_norm_eps must be < 1"),
    (TINY, ["model.deepseek_v3.routed_scaling_factor=nan"], r"model\.deepseek_v3\.routed_scaling_factor must be a finite number"),
    (TINY, ["parallel.pp=4"], r"model\.deepseek_v3\.num_layers \(3\) must be >= parallel\.pp"),
    (TINY, ["model.family=gpt"], r"model\.family.*expected one of " + ", ".join(map(repr, FAMILY_PACKAGES))),
    (TINY, ["parallel.cp=2"], r"parallel\.cp=2 is not supported for model\.family=deepseek_v3"),
    (TINY, ["parallel.tp=8"], r"model\.deepseek_v3\.num_attention_heads \(4\) must be divisible by parallel\.tp"),
    (TINY, ["train.precision=fp8", "train.device=cuda"], r"train\.precision=fp8 supports model\.family=llama only "
                                                         r"\(got deepseek_v3\)"),
])
def test_bad_family_configs_name_the_key(path, overrides, match):
    with pytest.raises(ConfigError, match=match):
        _check(path, overrides)


def test_expert_parallel_needs_divisible_routed_experts():
    with pytest.raises(ConfigError, match=r"model\.deepseek_v3\.n_routed_experts \(8\) must be divisible by "
                                          r"parallel\.ep \(3\)"):
        _check(TINY, ["parallel.ep=3", "parallel.dp=3"], world_size=3)
    with pytest.raises(ConfigError, match=r"parallel\.ep=2 needs MoE layers"):
        _check(TINY, ["parallel.ep=2", "parallel.dp=2", "model.deepseek_v3.first_k_dense_replace=3"], world_size=2)
    _check(TINY, ["parallel.ep=2", "parallel.dp=2"], world_size=2)


def test_a_vlm_language_model_stays_llama():
    cfg = load_config(VLMRunConfig, None, ["data.mock=true", "model.language.family=deepseek_v3"])
    with pytest.raises(ConfigError, match=r"model\.language\.family=deepseek_v3"):
        validate_vlm_config(cfg)


def test_the_registry_builds_the_chosen_family():
    from mmtrain.models.deepseek_v3.model import DeepseekV3Model
    from mmtrain.models.llama.model import GPTModel
    from mmtrain.models.registry import FAMILIES, family_named, model_family

    ds = load_config(GPTRunConfig, TINY, []).model
    llama = load_config(GPTRunConfig, None, []).model
    assert all(family_named(name) is FAMILIES[name] for name in FAMILY_PACKAGES)  # each loads from the table
    stage = model_family(ds).build_stage(ds, (1, 3), False, True)
    assert isinstance(stage, DeepseekV3Model) and list(stage.layers) == ["1", "2"] and stage.embed is None
    assert isinstance(model_family(llama).build_stage(llama, (0, 2), True, True), GPTModel)
    assert model_family(ds).has_routed_experts(ds) and not model_family(llama).has_routed_experts(llama)
    assert model_family(ds).flops_per_token(ds, 16) > 0


def test_a_family_outside_the_table_is_one_line_listing_the_table():
    cfg = load_config(GPTRunConfig, None, ["data.mock=true"])
    cfg.model.family = "gpt"  # set in code: the loader refuses it already (above)
    with pytest.raises(ConfigError, match=r"^model\.family='gpt' is not a model family; choose one of "
                                          + ", ".join(FAMILY_PACKAGES) + r" \(the table in "):
        validate_gpt_config(cfg)


@pytest.mark.parametrize("capability,overrides,match", [
    ("supports_cp", ["parallel.cp=2"], r"parallel\.cp=2 is not supported for model\.family=deepseek_v3"),
    ("supports_fp8", ["train.precision=fp8", "train.device=cuda"], r"train\.precision=fp8 supports model\.family="),
    ("supports_train_sampling", ["train.sample_every=1", "train.sample_prompts=[hi]", f"train.sample_tokenizer={TINY}"],
     r"train\.sample_every needs model\.family="),
])
def test_a_family_without_a_capability_is_refused_naming_the_key_and_the_families_with_it(capability, overrides,
                                                                                          match):
    from mmtrain.config.family_sections import families_with, section_class

    able = families_with(capability)
    assert not getattr(section_class("deepseek_v3"), capability) and able
    with pytest.raises(ConfigError, match=match) as info:
        _check(TINY, overrides)
    assert " or ".join(able) in str(info.value) or ", ".join(able) in str(info.value)
    assert "deepseek_v3" in str(info.value)


def test_a_config_section_lacking_a_member_of_the_interface_is_one_line(tmp_path, monkeypatch):
    """The config half of the contract: a family's config module must give ``SECTION``, a ``FamilySection``
    dataclass with every member of the section interface."""
    from mmtrain.config import family_sections
    from mmtrain.models.families import FamilyContractError

    package = tmp_path / "fake_section_family"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text(
        "from dataclasses import dataclass\nfrom mmtrain.models.families import FamilySection\n\n\n@dataclass\n"
        "class FakeConfig(FamilySection):\n    name: str = 'fake'\n    vocab_size: int = 8\n\n\nSECTION = FakeConfig\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(FAMILY_PACKAGES, "fake", "fake_section_family")
    with pytest.raises(FamilyContractError, match=r"^model family 'fake': fake_section_family\.config\.FakeConfig "
                                                  r"lacks hidden_size, num_layers, check, check_layout, lora_targets "
                                                  r"\(the section interface of FamilySection\)$"):
        family_sections.section_class("fake")
    monkeypatch.setitem(FAMILY_PACKAGES, "fake", "no_such_family")
    with pytest.raises(FamilyContractError, match=r"^model family 'fake': no module no_such_family\.config"):
        family_sections.section_class("fake")
