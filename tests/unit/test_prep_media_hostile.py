"""`mmtrain-prep media` on hostile rows: whatever a row holds, it is written or rejected with a stable
reason and the run goes on (also under --resume and with worker processes); a fuzz test over random JSON
values, bytes and paths; symlinks out of a folder input; an unwritable output folder."""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path

import pytest

from dataprep.cli import main

pytest.importorskip("megatron.energon")
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument:UserWarning")

DEEP = '{"id": "deep", "image": "ok.png", "caption": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
HUGE_INT = '{"id": ' + "7" * 5000 + ', "image": "ok.png", "caption": "x"}'
HOSTILE = {  # line text -> the reason code it must get
    json.dumps({"id": "nul", "image": "o\u0000k.png", "caption": "x"}): "bad_field",
    HUGE_INT: "malformed_line",
    DEEP: "malformed_line",
    '{"id": "surrogate\\ud800", "image": "ok.png", "caption": "x"}': "bad_field",
    '{"id": "s2", "image": "ok.png", "caption": "lone \\udc00"}': "bad_field",
    json.dumps({"id": "nested", "image": "ok.png", "caption": "x", "e": [[[[[[[[[[[]]]]]]]]]]] * 1}): None,
    '{"id": "deep-200", "image": "ok.png", "caption": "x", "e": ' + "[" * 200 + "]" * 200 + "}": "bad_field",
    json.dumps({"id": "garbage", "image": "garbage.png", "caption": "x"}): "unreadable_media",
    json.dumps({"id": "longpath", "image": "a" * 5000 + ".png", "caption": "x"}): "unreadable_media",
    json.dumps({"id": 10**4000, "image": "ok.png", "caption": "big but legal id"}): None,
    json.dumps({"id": "nan", "image": "ok.png", "caption": "x", "score": float("nan")}): None,
}


def _png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 4), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def _media_folder(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "ok.png").write_bytes(_png())
    (root / "garbage.png").write_bytes(b"not an image at all " * 4)
    return root


def prep(manifest, out, *extra) -> int:
    return main(["media", "--input", str(manifest), "--output", str(out), "--no-progress", "--val-ratio", "0",
                 *map(str, extra)])


def _rejects(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]


def _energon_samples(out: Path) -> list[dict]:
    from megatron.energon import (Cooker, DefaultTaskEncoder, WorkerConfig, get_savable_loader,
                                  get_train_dataset, stateless)

    @stateless
    def cook(sample):
        return sample

    class Raw(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

    ds = get_train_dataset(str(out), batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                           worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0), repeat=False,
                           task_encoder=Raw(), dataset_config="crude.yaml")
    return list(get_savable_loader(ds, gc_collect_every_n_steps=0))  # its gc.collect() is most of the time


def _one_error_line(err: str) -> str:
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_hostile_rows_are_rejects_and_the_run_goes_on(tmp_path, workers):
    d = _media_folder(tmp_path / "in")
    lines = [json.dumps({"id": "first", "image": "ok.png", "caption": "fine"}), *HOSTILE,
             json.dumps({"id": "last", "image": "ok.png", "caption": "fine"})]
    manifest = d / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert prep(manifest, out, "--workers", workers) == 0
    got = {r["line"]: r["code"] for r in _rejects(out)}
    want = {i + 2: code for i, code in enumerate(HOSTILE.values()) if code}
    assert got == want
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["rows_read"] == len(lines) == counts["written"] + counts["rejected"]
    keys = {s["__key__"] for s in _energon_samples(out)}
    assert {"first", "last", "nested", "nan"} <= keys and len(keys) == counts["written"]


def test_reasons_are_stable_strings(tmp_path):
    d = _media_folder(tmp_path / "in")
    manifest = d / "m.jsonl"
    manifest.write_text(json.dumps({"id": "g", "image": "garbage.png", "caption": "x"}) + "\n"
                        + json.dumps({"id": "ok", "image": "ok.png", "caption": "x"}) + "\n")
    runs = []
    for name in ("a", "b"):
        assert prep(manifest, tmp_path / name, "--workers", "1") == 0
        runs.append((tmp_path / name / "rejects.jsonl").read_text())
    assert runs[0] == runs[1] and " at 0x" not in runs[0], runs[0]
    assert "cannot identify image file" in runs[0]


def test_resume_passes_the_same_hostile_rows(tmp_path):
    d = _media_folder(tmp_path / "in")
    good = [json.dumps({"id": f"g{i}", "image": "ok.png", "caption": "padding " * 300}) for i in range(12)]
    lines = good[:6] + list(HOSTILE) + good[6:]
    manifest = d / "m.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    out, whole = tmp_path / "out", tmp_path / "whole"
    assert prep(manifest, whole, "--workers", "1", "--shard-size", "12KB") == 0
    assert prep(manifest, out, "--workers", "1", "--shard-size", "12KB", "--stop-after-shards", "1") == 130
    assert prep(manifest, out, "--workers", "1", "--shard-size", "12KB", "--resume") == 0
    assert _rejects(out) == _rejects(whole)
    assert sorted(p.name for p in out.glob("shard-*")) == sorted(p.name for p in whole.glob("shard-*"))
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in whole.glob("shard-*"))
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["rows_read"] == len(lines) == counts["written"] + counts["rejected"]


def test_folder_input_refuses_symlinks_out_of_it(tmp_path):
    outside = _media_folder(tmp_path / "elsewhere")
    (outside / "cap.txt").write_text("secret caption")
    d = _media_folder(tmp_path / "in")
    (d / "garbage.png").unlink()
    (d / "ok.txt").write_text("a caption")
    (d / "link.png").symlink_to(outside / "ok.png")                # media file pointing out
    (d / "link.txt").write_text("caption of the link")
    (d / "inner.png").symlink_to(d / "ok.png")                     # pointing inside: fine
    (d / "inner.txt").write_text("inner caption")
    (d / "capout.png").write_bytes(_png())                         # its caption points out
    (d / "capout.txt").symlink_to(outside / "cap.txt")
    (d / "sub").symlink_to(outside, target_is_directory=True)      # a linked folder: not walked, reported
    (d / "dangling.png").symlink_to(d / "gone.png")                # a dangling link: missing_file
    (d / "dangling.txt").write_text("caption of nothing")
    (d / os.fsdecode(b"bad\xff.png")).write_bytes(_png())         # not a UTF-8 name
    out = tmp_path / "out"
    assert main(["media", "--input", str(d), "--output", str(out), "--no-progress", "--workers", "1",
                 "--val-ratio", "0"]) == 0
    by_file = {json.loads(r["record"])["file"]: r for r in _rejects(out)}
    assert by_file["link.png"]["code"] == "outside_path" and "--allow-outside" in by_file["link.png"]["reason"]
    assert by_file["capout.png"]["code"] == "outside_path"
    assert by_file["sub"]["code"] == "bad_field" and "not followed" in by_file["sub"]["reason"]
    assert by_file["dangling.png"]["code"] == "missing_file"
    assert by_file["bad\udcff.png"]["code"] == "bad_field" and "UTF-8" in by_file["bad\udcff.png"]["reason"]
    assert {s["__key__"] for s in _energon_samples(out)} == {"ok", "inner"}
    out2 = tmp_path / "out2"
    assert main(["media", "--input", str(d), "--output", str(out2), "--no-progress", "--workers", "1",
                 "--val-ratio", "0", "--allow-outside"]) == 0
    assert {s["__key__"] for s in _energon_samples(out2)} == {"ok", "inner", "link", "capout"}


def test_unwritable_output_is_one_line(tmp_path, capsys):
    d = _media_folder(tmp_path / "in")
    manifest = d / "m.jsonl"
    manifest.write_text(json.dumps({"id": "ok", "image": "ok.png", "caption": "x"}) + "\n")
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    assert prep(manifest, blocker / "out", "--workers", "1") == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "cannot write the output" in line and str(blocker) in line, line
    if os.geteuid() != 0:  # root writes into read-only folders
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o500)
        try:
            assert prep(manifest, locked, "--workers", "1") == 2
            assert "Permission denied" in _one_error_line(capsys.readouterr().err)
        finally:
            locked.chmod(0o700)


def test_fuzz_rows_read_equal_written_plus_rejected(tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    d = _media_folder(tmp_path / "in")
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
                        st.sampled_from([10**300, -(10**4000), "", " ", "\u0000", "ok.png"]))
    values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.text(max_size=8), inner, max_size=3)),
                          max_leaves=8)
    paths = st.one_of(st.sampled_from(["ok.png", "garbage.png", "missing.png", "../ok.png", "/etc/passwd",
                                       "ok.png\u0000.png", "./ok.png", "in/../ok.png", "ok.PNG", ".", ""]),
                      st.text(max_size=30), values)
    rows = st.fixed_dictionaries(
        {}, optional={"id": values, "image": paths, "images": st.one_of(st.lists(paths, max_size=3), values),
                      "audio": paths, "caption": values, "text": values, "conversation": values,
                      "extra": values})
    line = st.one_of(
        rows.map(lambda r: json.dumps(r, ensure_ascii=False).encode("utf-8", "surrogatepass")),
        st.builds(lambda p, c, i: json.dumps({"id": i, "image": p, "caption": c}).encode(), paths,
                  st.text(max_size=10), st.text(max_size=10)),
        values.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=40),
        st.sampled_from([DEEP.encode(), HUGE_INT.encode(), b'{"image": "ok.png", "caption": "\\ud800"}']))

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                     HealthCheck.too_slow])
    @given(st.lists(line, min_size=0, max_size=6))
    def check(raw_lines):
        manifest = d / "fuzz.jsonl"
        good = json.dumps({"id": "the-good-row", "image": "ok.png", "caption": "always fine"}).encode()
        manifest.write_bytes(b"\n".join([*raw_lines, good]) + b"\n")
        out = Path(tempfile.mkdtemp(dir=tmp_path))
        assert prep(manifest, out, "--workers", "1") in (0, 2)  # 2: all rejected (the good row a duplicate)
        rejects = _rejects(out)
        records = [raw for raw in manifest.read_bytes().split(b"\n")[:-1] if _is_record(raw)]
        if not (out / "manifest.json").exists():
            assert len(rejects) == len(records)
            return
        counts = json.loads((out / "manifest.json").read_text())["counts"]
        assert counts["rows_read"] == len(records) == counts["written"] + counts["rejected"]
        assert counts["rejected"] == len(rejects) and all(r["code"] and r["reason"] for r in rejects)
        assert len(_energon_samples(out)) == counts["written"]

    check()


def _is_record(raw: bytes) -> bool:
    """What the manifest reader counts as a row: any line that is not blank (blank = whitespace only)."""
    try:
        return bool(raw.decode("utf-8").rstrip("\r").strip())
    except UnicodeDecodeError:
        return True
