"""`mmtrain-prep text` on bad input: every record written or reported, counts reconcile, --strict stops,
cut-short compressed files are reported, and a killed run leaves nothing that looks complete (and a complete
earlier output as it was)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataprep.cli import main as prep
from mmtrain.core.indexed import IndexedDataset
from tests.unit.test_tokenizer import build_sentencepiece

REPO = Path(__file__).resolve().parents[2]

# (raw line, reason fragment or None when the line is fine)
LINES = [
    (b'{"text": "good one"}', None),
    (b'{"text": "unterminated', "malformed JSON"),
    (b'{"body": "no text key"}', "missing key 'text'"),
    (b'{"text": 42}', "holds a number, not a string"),
    (b'{"text": null}', "holds null, not a string"),
    (b'{"text": "bad \xff\xfe bytes"}', "invalid UTF-8 at byte 14"),
    (b'[1, 2, 3]', "not a JSON object"),
    (b'{"text": "lone \\ud800 surrogate"}', "lone surrogate"),
    (b'', None),  # blank line: counted separately, not a record
    (b'{"text": ""}', None),  # empty document
    (b'{"text": "good two"}', None),
]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return build_sentencepiece(tmp_path_factory.mktemp("sp"))


@pytest.fixture()
def bad_file(tmp_path) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(line for line, _ in LINES) + b"\n")
    return path


def _outputs(prefix: Path) -> list[Path]:
    return [p for p in (Path(f"{prefix}{s}") for s in (".bin", ".idx", ".manifest.json")) if p.exists()]


@pytest.mark.parametrize("workers", ["0", "2"])
def test_every_bad_record_is_reported_and_counts_reconcile(tmp_path, bad_file, sp_model, workers, capsys):
    prefix = tmp_path / "out"
    assert prep(["text", "--input", str(bad_file), "--output-prefix", str(prefix), "--tokenizer", str(sp_model),
                 "--append-eod", "--workers", workers]) == 0
    rejects = [json.loads(x) for x in Path(f"{prefix}.rejects.jsonl").read_text().splitlines()]
    want = [(i + 1, reason) for i, (_, reason) in enumerate(LINES) if reason]
    assert [(r["line"], r["file"]) for r in rejects] == [(line, str(bad_file)) for line, _ in want]
    for r, (_, reason) in zip(rejects, want):
        assert reason in r["reason"], (r, reason)
    counts = json.loads(Path(f"{prefix}.manifest.json").read_text())["documents"]
    assert counts == {"read": 10, "written": 2, "empty": 1, "rejected": 7, "blank_lines": 1}
    assert counts["read"] == counts["written"] + counts["empty"] + counts["rejected"]
    ds = IndexedDataset(prefix)
    assert len(ds) == 2
    err = capsys.readouterr().err
    assert "read 10 documents = written 2 + empty 1 + rejected 7" in err and "rejects.jsonl" in err
    assert prep(["verify", str(prefix)]) == 0


def test_strict_stops_at_first_bad_record_and_writes_nothing(tmp_path, bad_file, sp_model, capsys):
    prefix = tmp_path / "out"
    assert prep(["text", "--input", str(bad_file), "--output-prefix", str(prefix), "--tokenizer", str(sp_model),
                 "--strict", "--workers", "0"]) == 2
    err = capsys.readouterr().err
    assert f"{bad_file}:2: malformed JSON" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == [bad_file]  # no outputs, no temporaries


@pytest.mark.parametrize("kind", ["gz", "zst"])
def test_cut_short_compressed_file_is_reported(tmp_path, sp_model, kind):
    import sentencepiece as spm
    import zstandard

    docs = [f"document {i} with some words to make it longer " * 3 for i in range(3000)]
    raw = b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs)
    packed = gzip.compress(raw) if kind == "gz" else zstandard.ZstdCompressor().compress(raw)
    path = tmp_path / f"cut.jsonl.{kind}"
    path.write_bytes(packed[: len(packed) // 2])
    prefix = tmp_path / "out"
    assert prep(["text", "--input", str(path), "--output-prefix", str(prefix), "--tokenizer", str(sp_model),
                 "--workers", "0", "--block-mb", "0.05"]) == 0
    rejects = [json.loads(x) for x in Path(f"{prefix}.rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 1 and "cut short" in rejects[0]["reason"]
    counts = json.loads(Path(f"{prefix}.manifest.json").read_text())["documents"]
    written = counts["written"]
    assert 0 < written < len(docs) and rejects[0]["line"] == written + 1
    assert counts["read"] == written + 1 and counts["rejected"] == 1
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(0, written, 97)] == [sp.encode(docs[i]) for i in range(0, written, 97)]


def test_unreadable_inputs_are_clear_errors(tmp_path, sp_model, capsys):
    base = ["--output-prefix", str(tmp_path / "o"), "--tokenizer", str(sp_model), "--workers", "0"]
    assert prep(["text", "--input", str(tmp_path / "nope.jsonl"), *base]) == 2
    assert prep(["text", "--input", str(tmp_path / "*.jsonl"), *base]) == 2
    (tmp_path / "d").mkdir()
    assert prep(["text", "--input", str(tmp_path / "d"), *base]) == 2
    err = capsys.readouterr().err
    assert "nope.jsonl not found" in err and "matches no file" in err and "holds no .jsonl" in err
    assert "Traceback" not in err


def _processes_with(text: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line contains ``text`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes() and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_killed_run_leaves_nothing_complete_looking(tmp_path, sp_model):
    docs = [{"text": f"line {i} " + "word " * 40} for i in range(4000)]
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    prefix = tmp_path / "out" / "corpus"
    args = ["--input", str(data), "--output-prefix", str(prefix), "--tokenizer", str(sp_model), "--append-eod",
            "--workers", "2", "--block-mb", "0.02"]
    cmd = [sys.executable, "-m", "dataprep", "text", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # a complete earlier run: the killed run must leave it exactly as it was (written beside, switched at the end)
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=REPO)
    assert len(_outputs(prefix)) == 3
    earlier = {p.name: p.read_bytes() for p in _outputs(prefix)}
    paused = [sys.executable, "-m", "tests.prep_text_paused", "3", "600", *args]  # sleeps after 3 blocks
    proc = subprocess.Popen(paused, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120  # generous bound for a loaded machine; not a timing assertion
        while time.monotonic() < deadline:
            temps = [p for p in prefix.parent.iterdir() if p.name.startswith(".corpus.bin.") and p.stat().st_size]
            if temps:
                break
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        assert temps, "no partial .bin temporary appeared"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert {p.name: p.read_bytes() for p in _outputs(prefix)} == earlier
    assert prep(["verify", str(prefix)]) == 0
    assert all(p.name.startswith(".") and p.name.endswith(".tmp") or p.name in earlier
               for p in prefix.parent.iterdir())
    deadline = time.monotonic() + 30  # its worker processes die with it (not left waiting forever)
    while _processes_with(str(prefix)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(str(prefix)) == []
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=REPO)  # a re-run completes normally
    assert prep(["verify", str(prefix)]) == 0
