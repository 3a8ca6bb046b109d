"""GPT samples: Megatron-equal indices, boundaries, splits, cache reuse/invalidation, packed inputs, resume."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from mmtrain.core.indexed import IndexedDataset
from mmtrain.data import gpt_indices
from mmtrain.data.blend import build_gpt_samples_from_config
from mmtrain.data.gpt_dataset import GPTSamples, SplitError, packed_document_inputs, samples_needed, split_document_ranges
from mmtrain.data.index_cache import IndexCacheTimeout
from mmtrain.data.loader import MicroBatches
from tests.data_helpers import EOD, run_config, write_text_dataset

# (seq_length, num_samples, split): one epoch, many epochs with a separate short last epoch, a long last
# epoch, and a split without a test part
CASES = [(16, 100, "969,30,1"), (16, 2600, "969,30,1"), (23, 1500, "80,20,0"), (8, 700, "9,1")]


def _megatron_dataset(prefix, documents, num_samples, seq_length, split_index, cache):
    gpt = pytest.importorskip("megatron.core.datasets.gpt_dataset")
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    from megatron.core.datasets.utils import Split

    class Tok:  # just what GPTDatasetConfig reads
        eod, pad, vocab_size, unique_identifiers = EOD, -1, 512, {"class": "Tok"}

    cfg = gpt.GPTDatasetConfig(random_seed=1234, sequence_length=seq_length, split="1", tokenizer=Tok(),
                               reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                               path_to_cache=str(cache))
    return gpt.GPTDataset(MegatronIndexed(str(prefix)), str(prefix), np.arange(*documents, dtype=np.int32),
                          num_samples, list(Split)[split_index], cfg)


@pytest.mark.parametrize("seq_length,num_samples,split", CASES)
def test_indices_and_samples_equal_megatron_core(tmp_path, seq_length, num_samples, split):
    prefix = write_text_dataset(tmp_path / "ds", num_docs=300)
    ranges = split_document_ranges(split, 300)
    for i, name in enumerate(("train", "valid")):
        ours = GPTSamples(prefix, seq_length, 1234, num_samples, ranges[name], name, tmp_path / "ours")
        theirs = _megatron_dataset(prefix, ranges[name], num_samples, seq_length, i, tmp_path / "megatron")
        assert np.array_equal(ours.document_index, theirs.document_index)
        assert np.array_equal(ours.sample_index, theirs.sample_index)
        assert np.array_equal(ours.shuffle_index, theirs.shuffle_index)
        assert len(ours) == len(theirs) >= num_samples
        for k in (0, 1, len(ours) // 2, len(ours) - 1):
            assert np.array_equal(ours[k], theirs._query_document_sample_shuffle_indices(k)[0])


def test_separate_last_epoch_rule():
    # 100 tokens per epoch, 10 samples per epoch of 9+1 tokens (the extra token overlaps)
    assert not gpt_indices.separate_last_epoch(100, 10, 9, 1)
    assert gpt_indices.num_epochs_for(100, 12, 9) == 2
    assert gpt_indices.separate_last_epoch(100, 12, 9, 2)  # 1 of ~11 samples from the last epoch
    assert not gpt_indices.separate_last_epoch(100, 20, 9, 2)  # last epoch almost fully used


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_samples_are_the_document_stream_cut_into_overlapping_windows(tmp_path, dtype):
    prefix = write_text_dataset(tmp_path / "ds", num_docs=50, dtype=dtype, token_range=(1, 70_000))
    s = GPTSamples(prefix, 16, 7, 200, cache_dir=tmp_path / "c")
    ds = IndexedDataset(prefix)
    stream = np.concatenate([ds[int(d)] for d in s.document_index]).astype(np.int64)
    starts = np.cumsum(np.concatenate([[0], ds.lengths[s.document_index]]))[s.sample_index[:, 0]] + s.sample_index[:, 1]
    assert np.all(np.diff(starts) == 16)  # consecutive samples advance by seq_length, sharing one token
    order = s.shuffle_index
    assert sorted(order.tolist()) == list(range(len(s)))
    for k in range(len(s)):
        assert np.array_equal(s[k], stream[starts[order[k]]:starts[order[k]] + 17])
    assert s[0].dtype == np.int64 and s[0].shape == (17,)


def test_empty_documents_are_skipped_like_megatron_does(tmp_path):
    from mmtrain.core.indexed import IndexedDatasetWriter

    lengths = np.array([5, 0, 7, 0, 0, 9, 3, 0, 11] * 5, np.int32)
    with IndexedDatasetWriter(tmp_path / "ds", np.uint16) as w:
        w.add(np.arange(1, lengths.sum() + 1, dtype=np.uint16), lengths)
        w.commit()
    ours = GPTSamples(tmp_path / "ds", 4, 1234, 60, cache_dir=tmp_path / "c")
    theirs = _megatron_dataset(tmp_path / "ds", (0, len(lengths)), 60, 4, 0, tmp_path / "m")
    assert np.array_equal(ours.sample_index, theirs.sample_index)
    assert all(np.array_equal(ours[k], theirs._query_document_sample_shuffle_indices(k)[0]) for k in range(len(ours)))


def test_splits_use_megatron_rounding_and_disjoint_documents(tmp_path):
    assert split_document_ranges("969,30,1", 1000) == {"train": (0, 969), "valid": (969, 999), "test": (999, 1000)}
    assert split_document_ranges("98,2", 10) == {"train": (0, 10), "valid": (10, 10), "test": (10, 10)}
    assert split_document_ranges("1,1,1", 10) == {"train": (0, 3), "valid": (3, 7), "test": (7, 10)}
    for bad in ("a,b", "1,2,3,4", "0,0,0", "-1,2"):
        with pytest.raises(SplitError, match="data.split"):
            split_document_ranges(bad, 10)
    prefix = write_text_dataset(tmp_path / "ds", num_docs=100)
    r = split_document_ranges("8,2", 100)
    valid = GPTSamples(prefix, 8, 1, 50, r["valid"], "valid", tmp_path / "c")
    assert set(np.unique(valid.document_index).tolist()) == set(range(80, 100))


def test_build_is_deterministic_across_processes(tmp_path):
    prefix = write_text_dataset(tmp_path / "ds", num_docs=80)
    a = GPTSamples(prefix, 16, 3, 300, cache_dir=tmp_path / "a")
    code = ("import sys, numpy as np; from mmtrain.data.gpt_dataset import GPTSamples; "
            "s = GPTSamples(sys.argv[1], 16, 3, 300, cache_dir=sys.argv[2]); "
            "print(np.stack([s[i] for i in range(len(s))]).sum(axis=1).tolist())")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code, str(prefix), str(tmp_path / "b")], check=True,
                         capture_output=True, text=True, env=env).stdout
    assert eval(out) == np.stack([a[i] for i in range(len(a))]).sum(axis=1).tolist()


def test_cache_is_reused_and_invalidated_by_what_shapes_it(tmp_path):
    prefix = write_text_dataset(tmp_path / "ds", num_docs=60)
    cache = tmp_path / "c"
    first = GPTSamples(prefix, 16, 1, 100, cache_dir=cache)
    assert first.built
    again = GPTSamples(prefix, 16, 1, 100, cache_dir=cache)
    assert not again.built and np.array_equal(again.shuffle_index, first.shuffle_index)
    assert GPTSamples(prefix, 16, 2, 100, cache_dir=cache).built  # seed
    assert GPTSamples(prefix, 8, 1, 100, cache_dir=cache).built  # seq_length
    assert GPTSamples(prefix, 16, 1, 5000, cache_dir=cache).built  # number of samples
    assert GPTSamples(prefix, 16, 1, 100, (0, 30), cache_dir=cache).built  # split range
    time.sleep(0.01)
    write_text_dataset(prefix, num_docs=60, seed=5)  # the data changes
    changed = GPTSamples(prefix, 16, 1, 100, cache_dir=cache)
    assert changed.built
    assert not GPTSamples(prefix, 16, 1, 100, cache_dir=cache).built
    assert not list(cache.glob(".*tmp"))  # atomic writes leave no temporaries


def test_default_cache_folder_is_next_to_the_dataset(tmp_path):
    prefix = write_text_dataset(tmp_path / "ds", num_docs=20)
    GPTSamples(prefix, 8, 1, 10)
    assert list((tmp_path / "ds.cache").glob("gpt-ds-train-*.json"))


def test_non_builder_rank_waits_then_fails_clearly(tmp_path):
    prefix = write_text_dataset(tmp_path / "ds", num_docs=20)
    with pytest.raises(IndexCacheTimeout, match="local rank 0.*index_build_timeout_s"):
        GPTSamples(prefix, 8, 1, 10, cache_dir=tmp_path / "c", build_timeout_s=0.3, index_builder=False)
    built = GPTSamples(prefix, 8, 1, 10, cache_dir=tmp_path / "c")
    loaded = GPTSamples(prefix, 8, 1, 10, cache_dir=tmp_path / "c", build_timeout_s=0.3, index_builder=False)
    assert built.built and not loaded.built


def test_who_builds_the_indices_is_an_argument_not_the_environment(tmp_path, monkeypatch):
    prefix = write_text_dataset(tmp_path / "ds", num_docs=20)
    monkeypatch.setenv("LOCAL_RANK", "1")  # what torchrun sets on a node's second process: not read here
    assert GPTSamples(prefix, 8, 1, 10, cache_dir=tmp_path / "c", build_timeout_s=0.3).built


def test_packed_document_inputs():
    E = 9
    tokens = torch.tensor([[5, 6, E, 7, 8, E, E, 1, 2],
                           [1, 2, 3, 4, 5, 6, 7, 8, 9]])
    pos, doc, loss = packed_document_inputs(tokens, E, True, True, True)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 0, 0], list(range(8))]
    assert doc.tolist() == [[0, 0, 0, 1, 1, 1, 2, 3], [0] * 8]
    assert loss.tolist() == [[1, 1, 0, 1, 1, 0, 0, 1], [1] * 8]  # the label 9 of row 2 is no input
    pos, doc, loss = packed_document_inputs(tokens, E, False, False, False)
    assert pos.tolist() == [list(range(8))] * 2 and doc.eq(0).all() and loss.eq(1).all()
    with pytest.raises(ValueError, match="end-of-document id"):
        packed_document_inputs(tokens, None, True, False, False)


def test_build_from_config_sizes_the_run_and_names_the_eod(tmp_path):
    prefix = write_text_dataset(tmp_path / "ds", num_docs=100)
    cfg = run_config(tmp_path, prefixes=[str(prefix)])
    cfg.train.global_batch_size = 8
    samples = build_gpt_samples_from_config(cfg, "train", 1)
    assert samples_needed(cfg, "train") == 80 and len(samples) >= 80 and samples.eod_id == EOD
    assert build_gpt_samples_from_config(cfg, "train", 4)[0].shape == (17,)
    cfg.train.global_batch_size, cfg.train.eval_every, cfg.train.eval_steps = 0, 5, 2
    assert samples_needed(cfg, "train", dp_size=2) == 10 * 2 * 2
    assert samples_needed(cfg, "valid", dp_size=2) == 3 * 2 * 2 * 2
    assert len(build_gpt_samples_from_config(cfg, "valid", 1)) >= 12


def test_resume_mid_epoch_continues_identically(tmp_path):
    prefix = write_text_dataset(tmp_path / "ds", num_docs=40)
    samples = GPTSamples(prefix, 16, 1, 60, cache_dir=tmp_path / "c")
    full = MicroBatches(samples, 3, 0, 1)
    reference = [full.next() for _ in range(12)]
    first = MicroBatches(samples, 3, 0, 1)
    for _ in range(5):
        first.next()
    state = first.state_dict()
    reopened = GPTSamples(prefix, 16, 1, 60, cache_dir=tmp_path / "c")  # a new process would load the cache
    resumed = MicroBatches(reopened, 3, 0, 1)
    resumed.load_state_dict(state)
    assert all(torch.equal(resumed.next(), reference[k]) for k in range(5, 12))
    assert samples.num_epochs == 1 and len(samples) > 12 * 3  # the state was saved mid-epoch


@pytest.mark.parametrize("overrides, message", [
    (["data.split=9;x"], "data.split='9;x'"),
    (["data.prefixes=[a, b]", "data.weights=[1.0]"], "data.weights has 1 values but data.prefixes has 2"),
    (["data.prefixes=[a]", "data.weights=[0.0]"], r"data.weights\[0\] must be > 0, got 0.0"),
    (["data.blend=spec.yaml", "data.weights=[1.0]"], "data.weights applies to data.prefixes"),
    (["data.index_build_timeout_s=0"], "data.index_build_timeout_s must be > 0"),
])
def test_data_config_checks(overrides, message):
    from mmtrain.config.loader import ConfigError, load_config
    from mmtrain.config.schema import GPTRunConfig
    from mmtrain.config.validate import validate_gpt_config

    cfg = load_config(GPTRunConfig, None, ["data.mock=true", *overrides])
    with pytest.raises(ConfigError, match=message):
        validate_gpt_config(cfg)


def test_a_failed_build_leaves_no_entry_and_no_temporaries(tmp_path):
    from mmtrain.data.index_cache import IndexCache

    cache = IndexCache(tmp_path / "c", "x", {"a": 1})

    def build(put):
        put("first", np.arange(10))
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        cache.load_or_build(build)
    assert not cache.exists() and list((tmp_path / "c").iterdir()) == []
    arrays, built = cache.load_or_build(lambda put: put("first", np.arange(3)))
    assert built and arrays["first"].tolist() == [0, 1, 2] and not arrays["first"].flags.writeable
