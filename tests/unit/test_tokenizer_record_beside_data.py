"""A checkpoint's tokenizer record names the path given to mmtrain-prep, relative to where that ran: the file is
found in the run's data folder when it is not there from the current directory (quantize, export, generate)."""

import json

from mmtrain.core.tokenizer_record import checkpoint_tokenizer_record


def _meta(tmp_path, record_in_complete: bool):
    data = tmp_path / "data"
    data.mkdir(parents=True)
    (data / "sp.model").write_bytes(b"model")
    rec = {"type": "sentencepiece", "path": "sp.model", "sha256": "0" * 64}
    (data / "text.manifest.json").write_text(json.dumps({"tokenizer": rec}))
    meta = {"config": {"data": {"prefixes": ["1.0", str(data / "text")]}}}
    if record_in_complete:
        meta["tokenizer"] = rec
    return meta, data


def test_a_relative_path_missing_here_is_found_beside_the_data(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for in_complete in (True, False):
        meta, data = _meta(tmp_path / str(in_complete), in_complete)
        rec, where = checkpoint_tokenizer_record(meta)
        assert rec["path"] == str(data / "sp.model")
        assert rec["sha256"] == "0" * 64
        assert where == ("complete.json" if in_complete else f"{data / 'text'}.manifest.json")


def test_a_path_that_exists_here_or_nowhere_is_kept(tmp_path, monkeypatch):
    meta, data = _meta(tmp_path, True)
    monkeypatch.chdir(data)  # sp.model exists from here: as recorded
    assert checkpoint_tokenizer_record(meta)[0]["path"] == "sp.model"
    monkeypatch.chdir(tmp_path)
    (data / "sp.model").unlink()  # nowhere: as recorded (the caller's error names it)
    assert checkpoint_tokenizer_record(meta)[0]["path"] == "sp.model"
