"""`mmtrain-prep text` and its own outputs: a rerun into the input folder never reads or destroys the previous
dataset, a run that writes nothing fails (exit 2) and leaves the earlier output intact, folder inputs say
what they take and skip, and an unwritable output is one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dataprep.cli import main as prep
from mmtrain.core.indexed import IndexedDataset
from tests.unit.test_tokenizer import build_sentencepiece


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return build_sentencepiece(tmp_path_factory.mktemp("sp"))


def _text(args, sp_model) -> int:
    return prep(["text", *map(str, args), "--tokenizer", str(sp_model), "--workers", "0"])


def _snapshot(prefix: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(prefix.parent.glob(prefix.name + ".*"))}


def _one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_rerun_with_prefix_inside_the_input_folder_keeps_and_ignores_its_outputs(tmp_path, sp_model, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5))
                                  + '{"text": 5}\n')
    (data / "c.JSONL").write_text(json.dumps({"text": "upper-case suffix"}) + "\n")
    (data / "gone.jsonl").symlink_to(tmp_path / "nowhere.jsonl")
    prefix = data / "out"
    assert _text(["--input", data, "--output-prefix", prefix], sp_model) == 0
    first = _snapshot(prefix)
    assert {"out.bin", "out.idx", "out.manifest.json", "out.rejects.jsonl"} <= set(first)
    err = capsys.readouterr().err
    assert "1 input file(s)" in err and "c.JSONL" in err and "dangling symlink" in err, err

    assert _text(["--input", data, "--output-prefix", prefix], sp_model) == 0  # the same command again
    err = capsys.readouterr().err
    assert "read 6 documents = written 5 + empty 0 + rejected 1" in err, err
    assert "this run's output" in err and "out.manifest.json" in err, err
    manifest = json.loads((data / "out.manifest.json").read_text())
    assert [Path(i["path"]).name for i in manifest["inputs"]] == ["a.jsonl"]
    assert {Path(s["path"]).name: s["reason"] for s in manifest["skipped_inputs"]}["gone.jsonl"] == "dangling symlink"
    second = _snapshot(prefix)
    assert second["out.bin"] == first["out.bin"] and second["out.idx"] == first["out.idx"]
    assert len(IndexedDataset(prefix)) == 5
    assert prep(["verify", str(prefix)]) == 0

    # naming the run's own output as an input is refused before anything is touched
    assert _text(["--input", data / "out.rejects.jsonl", "--output-prefix", prefix], sp_model) == 2
    assert "output of this run" in _one_error_line(capsys.readouterr().err)
    assert _snapshot(prefix) == second


def test_a_run_that_writes_no_document_fails_and_keeps_the_earlier_output(tmp_path, sp_model, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"body": "x"}) + "\n" + json.dumps({"body": "y"}) + "\n" + '{"text": 3}\n')
    prefix = tmp_path / "out" / "ds"

    assert _text(["--input", bad, "--output-prefix", prefix], sp_model) == 2  # nothing there before
    line = _one_error_line(capsys.readouterr().err)
    assert "no documents written: 3 read, 3 rejected (missing_key: 2, not_a_string: 1)" in line, line
    assert f"see {prefix}.rejects.jsonl" in line
    assert sorted(p.name for p in prefix.parent.iterdir()) == ["ds.rejects.jsonl"]  # no .bin/.idx/manifest
    codes = [json.loads(x)["code"] for x in Path(f"{prefix}.rejects.jsonl").read_text().splitlines()]
    assert codes == ["missing_key", "missing_key", "not_a_string"]

    assert _text(["--input", good, "--output-prefix", prefix], sp_model) == 0
    assert not Path(f"{prefix}.rejects.jsonl").exists()  # the new complete set has no rejects
    capsys.readouterr()
    before = _snapshot(prefix)
    assert _text(["--input", good, "--output-prefix", prefix, "--json-keys", "missing"], sp_model) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "3 rejected (missing_key: 3)" in line and f"{prefix}.failed.rejects.jsonl" in line, line
    after = _snapshot(prefix)
    assert set(after) == set(before) | {"ds.failed.rejects.jsonl"}
    assert all(after[name] == data for name, data in before.items())
    assert len(IndexedDataset(prefix)) == 3 and prep(["verify", str(prefix)]) == 0
    assert not [p for p in prefix.parent.iterdir() if p.name.endswith(".tmp")]

    # the next complete run replaces the set and clears the failed run's log
    assert _text(["--input", good, "--output-prefix", prefix], sp_model) == 0
    assert not Path(f"{prefix}.failed.rejects.jsonl").exists()


def test_only_empty_documents_is_a_failure_too(tmp_path, sp_model, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"text": ""}) + "\n\n")
    assert _text(["--input", empty, "--output-prefix", tmp_path / "o"], sp_model) == 2
    assert "1 empty (no tokens; --keep-empty writes them)" in _one_error_line(capsys.readouterr().err)
    assert _text(["--input", empty, "--output-prefix", tmp_path / "o", "--keep-empty"], sp_model) == 2
    assert "cannot be memory-mapped" in _one_error_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.jsonl"]


def test_a_failed_run_midway_keeps_the_earlier_output(tmp_path, sp_model, capsys):
    good = tmp_path / "good.jsonl"
    good.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(3)))
    prefix = tmp_path / "ds"
    assert _text(["--input", good, "--output-prefix", prefix], sp_model) == 0
    capsys.readouterr()
    before = _snapshot(prefix)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "fine"}) + "\n{broken\n")
    assert _text(["--input", bad, "--output-prefix", prefix, "--strict"], sp_model) == 2
    _one_error_line(capsys.readouterr().err)
    assert _snapshot(prefix) == before


def test_output_under_a_file_is_one_line(tmp_path, sp_model, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "hello"}) + "\n")
    assert _text(["--input", src, "--output-prefix", src / "ds"], sp_model) == 2  # a file where a folder should be
    line = _one_error_line(capsys.readouterr().err)
    assert f"cannot write the output {src / 'ds'}: {src}:" in line, line


def test_an_unwritable_output_is_found_before_the_tokenizer_loads(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "hello"}) + "\n")
    assert prep(["text", "--input", str(src), "--output-prefix", str(src / "ds"), "--tokenizer",
                 str(tmp_path / "no-such.model")]) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "cannot write the output" in line, line
    assert not (src.parent / "ds").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_unwritable_output_folder_is_one_line(tmp_path, sp_model, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "hello"}) + "\n")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert _text(["--input", src, "--output-prefix", locked / "ds"], sp_model) == 2
        line = _one_error_line(capsys.readouterr().err)
        assert "cannot write the output" in line and "Permission denied" in line, line
        assert _text(["--input", src, "--output-prefix", locked / "sub" / "ds"], sp_model) == 2
        assert "Permission denied" in _one_error_line(capsys.readouterr().err)
    finally:
        locked.chmod(0o700)
