"""`mmtrain-prep media` end to end with the real megatron-energon: loading, splits, determinism, resume."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest

from dataprep.cli import main
from dataprep.samples_media import write_media_samples

pytest.importorskip("megatron.energon")
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument:UserWarning",
                                        "ignore:Video container unit is seconds:RuntimeWarning")


def prep(inp, out, *extra) -> int:
    inputs = [str(p) for p in (inp if isinstance(inp, (list, tuple)) else [inp])]
    return main(["media", "--input", *inputs, "--output", str(out), "--no-progress", *map(str, extra)])


def shard_files(out: Path) -> dict[str, bytes]:
    """Every file a loader reads, by name (index.sqlite excluded: compared by rows instead)."""
    files = {p.name: p.read_bytes() for p in sorted(out.glob("shard-*"))}
    for name in (".info.json", "split.yaml", "dataset.yaml", "crude.yaml", "index.uuid"):
        files[name] = (out / ".nv-meta" / name).read_bytes()
    files["rejects.jsonl"] = (out / "rejects.jsonl").read_bytes()
    return files


def sqlite_rows(out: Path):
    db = sqlite3.connect(out / ".nv-meta" / "index.sqlite")
    try:
        return sorted(db.execute("SELECT * FROM samples")), sorted(db.execute("SELECT * FROM sample_parts"))
    finally:
        db.close()


def sqlite_layout(out: Path):
    """Columns of each table and the columns of each index (not the SQL text, which differs in layout)."""
    db = sqlite3.connect(out / ".nv-meta" / "index.sqlite")
    try:
        layout = {}
        for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY name"):
            layout[table] = [tuple(r[1:6]) for r in db.execute(f"PRAGMA table_info({table})")]
            for idx in sorted(r[1] for r in db.execute(f"PRAGMA index_list({table})")):
                layout[f"{table}:{idx}"] = [r[2] for r in db.execute(f"PRAGMA index_info({idx})")]
        return layout
    finally:
        db.close()


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """The sample media set: 24 images (2 with a conversation), 4 audio clips (wav/flac/mp3/ogg), 1 video."""
    root = tmp_path_factory.mktemp("media")
    manifest = write_media_samples(root / "in", num_images=24, num_audio=4, video=True)
    rows = [json.loads(line) for line in manifest.read_text().splitlines()]
    with open(root / "in" / "captions.jsonl", "w") as f:
        for row in rows:
            if "image" in row and "caption" in row:
                f.write(json.dumps(row) + "\n")
    return root / "in"


def _loader(path, split="train", task_encoder=None, dataset_config=None):
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset, get_val_dataset

    wc = WorkerConfig(rank=0, world_size=1, num_workers=0)
    kw = {"task_encoder": task_encoder} if task_encoder is not None else {}
    if dataset_config:
        kw["dataset_config"] = dataset_config
    if split == "train":
        ds = get_train_dataset(str(path), batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                               worker_config=wc, repeat=False, **kw)
    else:
        ds = get_val_dataset(str(path), batch_size=None, worker_config=wc, **kw)
    return get_loader(ds)


def _crude_encoder():
    from megatron.energon import Cooker, DefaultTaskEncoder, stateless

    @stateless
    def cook(sample):
        return sample

    class Raw(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

    return Raw()


def test_captions_load_as_captioning_samples(media, tmp_path):
    from megatron.energon import CaptioningSample

    out = tmp_path / "out"
    assert prep(media / "captions.jsonl", out, "--val-ratio", "0.25", "--shard-size", "30KB", "--workers", "1") == 0
    want = {json.loads(line)["id"]: json.loads(line)["caption"] for line in (media / "captions.jsonl").open()}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["sample_type"] == "captioning"
    assert manifest["counts"]["rows_read"] == len(want) == manifest["counts"]["written"]
    seen = {}
    for split in ("train", "val"):
        n = 0
        for sample in _loader(out, split):
            assert isinstance(sample, CaptioningSample)
            assert sample.image.ndim == 3 and sample.image.shape[0] == 3 and sample.image.shape[1] >= 48
            assert sample.__key__ not in seen
            seen[sample.__key__] = sample.caption
            n += 1
        assert n == manifest["counts"]["splits"][split] > 0  # 0.25 of 22 rows: val is not empty
    assert seen == want
    assert len(manifest["shards"]) > 2  # several shards per split at 30KB
    crude = list(_loader(out, task_encoder=_crude_encoder(), dataset_config="crude.yaml"))  # same set, raw
    assert len(crude) == manifest["counts"]["splits"]["train"]
    assert all(s["__subflavors__"] == {"mmtrain_media": "image"} and "txt" in s for s in crude)
    assert all(s["name"].startswith("shard-") for s in manifest["shards"])


def test_audio_and_video_load_as_crude_samples_and_decode(media, tmp_path):
    import av

    out = tmp_path / "out"
    assert prep(media / "manifest.jsonl", out, "--val-ratio", "0", "--workers", "2", "--video-frames", "3") == 0
    assert "CrudeWebdataset" in (out / ".nv-meta" / "dataset.yaml").read_text()
    by_key = {s["__key__"]: s for s in _loader(out, task_encoder=_crude_encoder())}
    assert len(by_key) == 29
    for key, ext in (("clip-000", "wav"), ("clip-001", "flac"), ("clip-002", "mp3")):
        audio = by_key[key][ext].get_audio()  # energon's AVDecoder (PyAV)
        assert audio.audio_clips[0].numel() > 4000, key
        assert by_key[key]["txt"].startswith("A steady")
        assert by_key[key]["json"]["audio"]["duration"] > 0.4
    ogg = by_key["clip-003"]["ogg"]  # energon does not auto-decode .ogg: raw bytes for the cooker
    import io

    with av.open(io.BytesIO(ogg)) as c:
        assert sum(f.samples for f in c.decode(audio=0)) > 4000
    video = by_key["slide-000"]
    frames = video["mp4"].get_frames(video_decode_audio=False)
    assert frames.video_clips[0].shape[0] == 16 and video["json"]["video"]["frames"] == 16
    assert video["json"]["video"]["fps"] == 8.0 and abs(video["json"]["video"]["duration"] - 2.0) < 0.2
    assert video["frame000.jpg"].shape[0] == 3 and "frame002.jpg" in video
    conv = by_key["img-00023"]["json"]["conversation"]
    assert conv[0]["role"] == "user" and "txt" not in by_key["img-00023"]


def test_tar_index_and_sqlite_match_energon_prepare(media, tmp_path):
    """Our .tar.idx files and index rows are exactly what `energon prepare` computes for the same tars."""
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    out = tmp_path / "out"
    assert prep(media / "manifest.jsonl", out, "--val-ratio", "0.2", "--shard-size", "25KB", "--workers", "1") == 0
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    names = [s["name"] for s in json.loads((out / "manifest.json").read_text())["shards"]]
    for n in names:
        shutil.copy(out / n, theirs / n)
    WebdatasetPreparator.prepare_dataset(theirs, names, split_parts_patterns=[("train", "shard-train-.*"),
                                                                              ("val", "shard-val-.*")], workers=1)
    for n in names:
        assert (out / n).with_suffix(".tar.idx").read_bytes() == (theirs / n).with_suffix(".tar.idx").read_bytes()
    assert sqlite_rows(out) == sqlite_rows(theirs)
    assert sqlite_layout(out) == sqlite_layout(theirs)  # catches a schema change in a future energon
    assert json.loads((out / ".nv-meta/.info.json").read_text())["shard_counts"] == \
        json.loads((theirs / ".nv-meta/.info.json").read_text())["shard_counts"]


def test_same_shards_whatever_the_worker_count(media, tmp_path):
    runs = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        assert prep(media / "manifest.jsonl", out, "--shard-size", "20KB", "--val-ratio", "0.1",
                    "--workers", workers, "--image-format", "webp", "--max-side", "64") == 0
        runs[workers] = shard_files(out)
    assert len([n for n in runs[1] if n.endswith(".tar")]) > 4
    assert runs[1] == runs[2]


def test_interrupted_run_resumes_to_the_same_shards(media, tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    opts = ["--shard-size", "20KB", "--val-ratio", "0.15", "--workers", "2"]
    assert prep(media / "manifest.jsonl", full, *opts) == 0
    assert prep(media / "manifest.jsonl", cut, *opts, "--stop-after-shards", "3") == 130  # interrupted
    assert not list(cut.glob(".shard-*.tmp")) and not (cut / "manifest.json").exists()
    assert len(list(cut.glob("shard-*.tar"))) == 3
    assert prep(media / "manifest.jsonl", cut, *opts) == 2  # refuses to mix runs without --resume
    assert prep(media / "manifest.jsonl", cut, *opts[:-2], "--workers", "1", "--val-ratio", "0.3", "--resume") == 2
    assert prep(media / "manifest.jsonl", cut, *opts[:-1], "1", "--resume") == 0
    assert shard_files(cut) == shard_files(full)
    assert sqlite_rows(cut) == sqlite_rows(full)
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (full, cut))
    assert a["shards"] == b["shards"] and a["counts"] == b["counts"]
    assert main(["verify", str(cut)]) == 0
    assert prep(media / "manifest.jsonl", cut, *opts, "--resume") == 2  # complete: nothing to resume


def test_inspect_and_verify(media, tmp_path, capsys):
    out = tmp_path / "out"
    assert prep(media / "manifest.jsonl", out, "--shard-size", "40KB", "--workers", "1") == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--samples", "2"]) == 0
    text = capsys.readouterr().out
    assert "29 samples" in text and "audio 4" in text and "video 1" in text and "img-00000" in text
    assert main(["verify", str(out)]) == 0
    shard = sorted(out.glob("shard-train-*.tar"))[0]
    data = bytearray(shard.read_bytes())
    data[700] ^= 0xFF
    shard.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(out)]) == 1
    assert "sha256 differs" in capsys.readouterr().out
    (out / "manifest.json").unlink()
    assert main(["verify", str(out)]) == 2  # a PrepError: not a finished media folder
