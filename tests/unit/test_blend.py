"""Blends: the exact-share property, spec forms, every bad-spec class, config wiring, logging, cache."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmtrain.data.blend import BlendedSamples, build_gpt_samples_from_config
from mmtrain.data.blend_spec import BlendSpecError, blend_from_prefixes, load_blend_spec
from mmtrain.data.gpt_indices import build_blend_index
from tests.data_helpers import run_config, write_text_dataset


@settings(max_examples=150, deadline=None)
@given(weights=st.lists(st.floats(min_value=1e-3, max_value=1e3), min_size=1, max_size=8),
       size=st.integers(min_value=1, max_value=1500))
def test_every_prefix_of_the_blend_is_within_one_sample_of_its_share(weights, size):
    dataset_index, dataset_sample_index = build_blend_index(weights, size)
    w = np.asarray(weights) / np.sum(weights)
    onehot = np.zeros((size, len(w)), np.int64)
    onehot[np.arange(size), dataset_index] = 1
    counts = np.cumsum(onehot, axis=0)  # counts[n-1, i]: samples of dataset i among the first n
    expected = np.arange(1, size + 1)[:, None] * w[None, :]
    assert np.abs(counts - expected).max() <= 1 + 1e-9
    for i in range(len(w)):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert dataset_sample_index[dataset_index == i].tolist() == list(range(int(counts[-1, i])))


def test_blend_index_is_deterministic_and_rejects_bad_weights():
    a = build_blend_index([0.2, 0.5, 0.3], 1000)
    b = build_blend_index([2, 5, 3], 1000)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    for bad in ([], [1, 0], [1, -2]):
        with pytest.raises(ValueError, match="positive"):
            build_blend_index(bad, 10)


@pytest.fixture
def two(tmp_path):
    """Two datasets with disjoint token ranges, so a sample tells which one it came from."""
    a = write_text_dataset(tmp_path / "data" / "a", num_docs=120, token_range=(1, 100), seed=1)
    b = write_text_dataset(tmp_path / "data" / "b", num_docs=60, token_range=(200, 300), seed=2)
    return a, b


def _spec(tmp_path, text: str) -> Path:
    path = tmp_path / "blends" / "spec.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_spec_forms_resolve_relative_paths_against_the_spec_folder(tmp_path, two):
    a, b = (str(p) for p in two)
    forms = ["datasets:\n  - {path: ../data/a, weight: 0.7}\n  - {path: ../data/b, weight: 0.3}\n",
             "datasets: '0.7 ../data/a 0.3 ../data/b'\n",
             "datasets: [0.7, ../data/a, 0.3, ../data/b]\n",
             "0.7 ../data/a 0.3 ../data/b\n"]
    for text in forms:
        spec = load_blend_spec(_spec(tmp_path, text))
        assert [(e.path, e.weight) for e in spec.entries_for("train")] == [(a, 0.7), (b, 0.3)]
    spec = load_blend_spec(_spec(tmp_path, f"train: [{{path: {a}, weight: 2}}]\nvalid: '1 ../data/b'\n"))
    assert spec.entries_for("valid")[0].path == b and spec.entries_for("test") == []
    spec = load_blend_spec(_spec(tmp_path, "datasets: [../data/a, ../data/b]\nsplit: 9,1\n"))
    assert [e.weight for e in spec.datasets] == [None, None] and spec.split == "9,1"
    assert blend_from_prefixes(["0.5", a, "0.5", b], []).datasets[1].path == b


BAD_SPECS = [
    ("datasets: [{path: ../data/missing, weight: 1}]", "not found.*missing"),
    ("datasets: [{path: ../data/a, weight: 0}]", "weight 0 must be a positive"),
    ("datasets: [{path: ../data/a, weight: -1}]", "must be a positive"),
    ("datasets: [{path: ../data/a, weight: lots}]", "'lots' is not a number"),
    ("datasets: [{path: ../data/a, weight: true}]", "not a number"),
    ("datasets: '0.5 ../data/a nan ../data/b'", "must be a positive"),
    ("datasets: '0.5 ../data/a 0.5 ../data/a'", "listed twice"),
    ("datasets: [{path: ../data/a, weight: 1}, {path: ./../data/a, weight: 1}]", "listed twice"),
    ("datasets: '0.5 ../data/a 0.5'", "odd count"),
    ("datasets: [{path: ../data/a, weight: 1}, {path: ../data/b}]", "no weight while other entries"),
    ("datasets: [{path: ../data/a, wieght: 1}]", "unknown key 'wieght'"),
    ("datasets: [{path: ../data/a, type: webdataset}]", "type 'webdataset'"),
    ("datasets: [{path: ../data/nowhere, type: energon, weight: 1}]", "energon dataset folder .* not found"),
    ("datasets: []", "non-empty"),
    ("datasets: [{weight: 1}]", "missing 'path'"),
    ("datasets: '1 ../data/a'\ntrain: '1 ../data/b'", "not both"),
    ("split: 9,1\ntrain: '1 ../data/a'", "'split' only applies"),
    ("blend: '1 ../data/a'", "unknown key 'blend'"),
    ("{}", "no datasets"),
    ("datasets: [unclosed", "not valid YAML"),
]


@pytest.mark.parametrize("text,message", BAD_SPECS)
def test_bad_specs_name_the_file_and_the_problem(tmp_path, two, text, message):
    path = _spec(tmp_path, text)
    with pytest.raises(BlendSpecError, match=message) as err:
        load_blend_spec(path)
    assert str(path) in str(err.value)


def test_checks_before_training_tokenizer_vocab_energon_and_empty_split(tmp_path, two):
    write_text_dataset(tmp_path / "data" / "other", num_docs=20, tokenizer_sha="tok-b")
    write_text_dataset(tmp_path / "data" / "big", num_docs=20, max_id=70_000, dtype=np.int32)
    (tmp_path / "data" / "shards").mkdir()
    write_text_dataset(tmp_path / "data" / "eod7", num_docs=20, eod=7)
    write_text_dataset(tmp_path / "data" / "noeod", num_docs=20, eod=None)
    cases = [("datasets: '1 ../data/a 1 ../data/other'", "tokenized with .*tok-b.*one tokenizer"),
             ("train: '1 ../data/a'\nvalid: '1 ../data/other'", "tokenized with .*tok-b"),  # across splits too
             ("datasets: '1 ../data/big'", "ids up to 70000 but model.vocab_size is 512"),
             ("datasets: [{path: ../data/a, weight: 1}, {path: ../data/shards, type: energon, weight: 1}]",
              "energon .* does not support energon datasets yet"),
             ("train: '1 ../data/a'", "no valid blend"),
             ("datasets: '1 ../data/a 1 ../data/eod7'", "ends documents with token 7 .* same --eod-token"),
             ("datasets: '1 ../data/a 1 ../data/noeod'", "data.reset_position_ids needs end-of-document"),
             ("datasets: '1 ../data/a'\nsplit: 1,0,0", "no documents in the valid split")]
    for text, message in cases:
        cfg = run_config(tmp_path, blend=str(_spec(tmp_path, text)), reset_position_ids=True)
        with pytest.raises(BlendSpecError, match=message):
            build_gpt_samples_from_config(cfg, "valid" if "valid" in message else "train", 1)
    (tmp_path / "data" / "c.bin").write_bytes(b"")
    (tmp_path / "data" / "c.idx").write_bytes(b"garbage")
    cfg = run_config(tmp_path, blend=str(_spec(tmp_path, "datasets: '1 ../data/c'")))
    with pytest.raises(BlendSpecError, match=r"datasets\[1\].*c.idx"):
        build_gpt_samples_from_config(cfg, "train", 1)
    with pytest.raises(BlendSpecError, match="data.weights has 1 values for 2"):
        build_gpt_samples_from_config(run_config(tmp_path, prefixes=[str(p) for p in two], weights=[1.0]), "train", 1)


def test_blended_samples_follow_the_weights_and_log_the_mix(tmp_path, two, caplog):
    cfg = run_config(tmp_path, blend=str(_spec(tmp_path, "datasets: '0.25 ../data/a 0.75 ../data/b'")))
    cfg.train.steps, cfg.train.global_batch_size = 25, 8
    with caplog.at_level(logging.INFO, logger="mmtrain"):
        samples = build_gpt_samples_from_config(cfg, "train", 1)
    assert isinstance(samples, BlendedSamples) and len(samples) == 200 and samples.eod_id == 0
    from_b = [bool((samples[n] >= 200).any()) for n in range(len(samples))]
    for n in (1, 7, 50, 200):
        assert abs(sum(from_b[:n]) - 0.75 * n) <= 1
    text = caplog.text
    assert "a: weight 0.2500 -> 0.2500 of samples" in text and "b: weight 0.7500" in text and "epochs" in text
    again = build_gpt_samples_from_config(cfg, "train", 1)
    assert not again.built and all(not d.built for d in again.datasets)
    assert np.array_equal(again[123], samples[123])


def test_prefixes_without_weights_are_weighed_by_tokens(tmp_path, two):
    from mmtrain.core.indexed import IndexedDataset

    cfg = run_config(tmp_path, prefixes=[str(p) for p in two], split="1")
    samples = build_gpt_samples_from_config(cfg, "train", 1)
    tokens = np.array([IndexedDataset(p).num_tokens for p in two], np.float64)
    assert np.allclose(samples.weights, tokens / tokens.sum())
    cfg = run_config(tmp_path, prefixes=[str(p) for p in two], weights=[1.0, 3.0])
    assert build_gpt_samples_from_config(cfg, "train", 1).weights == [0.25, 0.75]


def test_per_split_blends_use_each_dataset_whole(tmp_path, two):
    spec = _spec(tmp_path, "train: '1 ../data/a'\nvalid: '1 ../data/b'\n")
    cfg = run_config(tmp_path, blend=str(spec))
    train, valid = build_gpt_samples_from_config(cfg, "train", 1), build_gpt_samples_from_config(cfg, "valid", 1)
    assert train.documents == (0, 120) and valid.documents == (0, 60)
    assert (valid[0] >= 200).sum() >= 1
