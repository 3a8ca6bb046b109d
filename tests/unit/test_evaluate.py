"""python -m mmtrain.evaluate: loss and perplexity over a split equal the plain per-sample computation."""

from __future__ import annotations

import json
import math

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
    table = capsys.readouterr().out
    assert "perplexity" in table and f"{got['loss']:.4f}" in table
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
    assert len(err.splitlines()) == 1 and err.startswith("mmtrain.evaluate: error:") and message in err, err
