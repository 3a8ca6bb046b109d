"""python -m mmtrain.evaluate: loss and perplexity over a split equal the plain per-sample computation; rank 0
shows progress; data prepared with another tokenizer than the checkpoint's is refused (and generate refuses such
a --tokenizer), the checkpoint of a run on a blend spec naming its tokenizer, which the HF export carries."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mmtrain.core.indexed import IndexedDataset
from mmtrain.data.gpt_dataset import GPTSamples
from mmtrain.data.splits import split_document_ranges
from mmtrain.evaluate import main as evaluate_main
from tests.eval_helpers import plain_loss, write_tiny_checkpoint, write_tiny_dataset

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evaluate")
    ckpt, model = write_tiny_checkpoint(tmp / "ckpt", tp=2)  # saved at TP2: read back at any layout
    prefix = write_tiny_dataset(tmp / "data")
    return tmp, ckpt, model, prefix


def _valid_samples(prefix, seq_length, split="80,20,0"):
    ds = IndexedDataset(prefix)
    b, e = split_document_ranges(split, len(ds))["valid"]
    tokens = int(ds.lengths[b:e].sum())
    n = (tokens - 1) // seq_length  # one pass: every token of the split once
    return GPTSamples(prefix, seq_length, 1234, n, documents=(b, e), split_name="valid",
                      cache_dir=str(prefix) + ".direct-cache"), n


def test_the_whole_split_once_equals_the_plain_computation(setup, capsys):
    tmp, ckpt, model, prefix = setup
    out = tmp / "result.json"
    rc = evaluate_main(["--ckpt", str(ckpt), "--data", str(prefix), "--data-split", "80,20,0", "--seq-length", "16",
                        "--batch-size", "3", "--output", str(out)])
    assert rc == 0
    samples, n = _valid_samples(prefix, 16)
    want, count = plain_loss(model, samples, range(n))
    got = json.loads(out.read_text())
    assert got["samples"] == n and got["tokens"] == count == n * 16
    assert got["loss"] == pytest.approx(want, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(want), rel=1e-5)
    assert got["layout"] == {"tp": 1, "pp": 1, "dp": 1}
    printed = capsys.readouterr()
    table = printed.out
    assert "perplexity" in table and f"{got['loss']:.4f}" in table
    progress = [line for line in printed.err.splitlines() if "warning" not in line]
    assert progress[0] == f"mmtrain.evaluate: scoring {n} samples of 17 tokens (valid split)"
    assert progress[-1] == f"mmtrain.evaluate: scored {n}/{n} samples (100%)"
    assert 3.0 < want < 2 * np.log(64)  # neither trivial nor broken


def test_max_samples_takes_the_first_samples_of_the_order_with_a_padded_last_batch(setup):
    tmp, ckpt, model, prefix = setup
    out = tmp / "five.json"
    assert evaluate_main(["--ckpt", str(ckpt), "--data", str(prefix), "--data-split", "80,20,0", "--seq-length",
                          "16", "--batch-size", "2", "--max-samples", "5", "--output", str(out)]) == 0
    samples, _ = _valid_samples(prefix, 16)
    want, count = plain_loss(model, samples, range(5))
    got = json.loads(out.read_text())
    assert (got["samples"], got["tokens"]) == (5, count)
    assert got["loss"] == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("bad, message", [
    (["--data", "{tmp}/missing"], "missing"),
    (["--ckpt", "{tmp}/nockpt"], "not a complete mmtrain checkpoint"),
    (["--ckpt", "{tmp}/nowhere"], "--ckpt {tmp}/nowhere: not found"),
    (["--batch-size", "0"], "--batch-size=0"),
    (["--data-split", "a,b"], "data.split='a,b'"),
])
def test_bad_input_is_one_line_and_exit_2(setup, capsys, bad, message):
    tmp, ckpt, _, prefix = setup
    args = {"--ckpt": str(ckpt), "--data": str(prefix), "--seq-length": "16"}
    for k, v in zip(bad[::2], bad[1::2]):
        args[k] = v.format(tmp=tmp)
    argv = [x for kv in args.items() for x in kv]
    (tmp / "nockpt").mkdir(exist_ok=True)
    assert evaluate_main(argv) == 2
    err = capsys.readouterr().err.strip()
    message = message.format(tmp=tmp)
    assert len(err.splitlines()) == 1 and err.startswith("mmtrain.evaluate: error:") and message in err, err


def _prep(tokenizer: Path, raw: Path, prefix: Path) -> Path:
    from dataprep.cli import main as prep_main

    assert prep_main(["text", "--input", str(raw), "--output-prefix", str(prefix), "--tokenizer", str(tokenizer),
                      "--append-eod", "--workers", "1"]) == 0
    return prefix


def _sentencepiece(folder: Path, raw: Path) -> Path:
    from dataprep.cli import main as prep_main

    assert prep_main(["train-tokenizer", "--input", str(raw), "--output-prefix", str(folder / "sp"),
                      "--vocab-size", "320"]) == 0
    return folder / "sp.model"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run on data named by a blend spec (as the user guide's), its tokenizer and another one of the same
    vocabulary size with data prepared by each."""
    from dataprep.samples import write_sample_jsonl
    from mmtrain.core.tokenizer import load_tokenizer
    from mmtrain.pretrain_gpt import main as pretrain_main

    tmp = tmp_path_factory.mktemp("trained")
    raw, raw_other = write_sample_jsonl(tmp / "raw.jsonl", 300, seed=1), write_sample_jsonl(tmp / "o.jsonl", 300, seed=7)
    tok, other = _sentencepiece(tmp / "tok", raw), _sentencepiece(tmp / "other", raw_other)
    assert load_tokenizer(tok).vocab_size == load_tokenizer(other).vocab_size  # the ids fit either way
    web, web_other = _prep(tok, raw, tmp / "web"), _prep(other, raw, tmp / "web_other")
    (tmp / "blend.yaml").write_text(f"split: 90,10,0\ndatasets:\n  - {{path: {web}, weight: 1}}\n")
    assert pretrain_main(["--config", "mmtrain:configs/gpt/tiny_cpu_mock.yaml", "data.mock=false",
                          f"data.blend={tmp / 'blend.yaml'}", "data.seq_length=16", "train.steps=2",
                          "train.micro_batch_size=2", "model.vocab_size=320", "checkpoint.save_every=2",
                          f"logging.run_dir={tmp / 'run'}"]) == 0
    return tmp, tmp / "run" / "checkpoints", tok, other, web, web_other


def test_a_run_on_a_blend_names_its_tokenizer_and_the_export_carries_it(trained, capsys):
    from mmtrain.convert.__main__ import main as convert_main
    from mmtrain.core.tokenizer import load_tokenizer

    tmp, ckpt, tok, _, _, _ = trained
    meta = json.loads((ckpt / "step_00000002" / "complete.json").read_text())
    assert meta["tokenizer"]["sha256"] == load_tokenizer(tok).checksum()
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(tmp / "hf")]) == 0  # no --tokenizer
    assert "(weights, tokenizer, generation_config.json)" in capsys.readouterr().out
    assert (tmp / "hf" / "tokenizer.json").is_file()


def test_data_of_another_tokenizer_is_refused_naming_both(trained, capsys):
    tmp, ckpt, tok, other, web, web_other = trained
    args = ["--ckpt", str(ckpt), "--data-split", "50,50,0", "--max-samples", "4"]
    assert evaluate_main([*args, "--data", str(web_other)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"--data {web_other} was prepared with sentencepiece tokenizer {other} (sha256 " in err
    assert f"but {ckpt}'s model was trained with sentencepiece tokenizer {tok} (sha256 " in err
    assert err.endswith("or pass --allow-other-tokenizer if this is intended")
    assert evaluate_main([*args, "--data", str(web_other), "--allow-other-tokenizer"]) == 0
    assert evaluate_main([*args, "--data", str(web)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_generate_refuses_another_tokenizer(trained, capsys):
    from mmtrain.generate import main as generate_main

    tmp, ckpt, tok, other, _, _ = trained
    assert generate_main(["--ckpt", str(ckpt), "--tokenizer", str(other), "--prompt", "Hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--tokenizer {other} is sentencepiece tokenizer" in err, err
    assert f"trained with sentencepiece tokenizer {tok}" in err and "--allow-other-tokenizer" in err
    assert generate_main(["--ckpt", str(ckpt), "--tokenizer", str(tok), "--prompt", "Hello",
                          "--max-new-tokens", "2"]) == 0
