"""`mmtrain-prep media` on bad input (every class lands in rejects.jsonl), folder input, re-encoding options."""

from __future__ import annotations

import io
import json
import wave

import pytest

from dataprep.cli import main
from dataprep.samples_media import _tone_wav

pytest.importorskip("megatron.energon")
pytestmark = pytest.mark.filterwarnings("ignore:'pin_memory' argument:UserWarning")


def prep(inputs, out, *extra) -> int:
    inputs = inputs if isinstance(inputs, list) else [inputs]
    return main(["media", "--input", *map(str, inputs), "--output", str(out), "--no-progress", "--workers", "1",
                 *map(str, extra)])


def _png(size=(40, 30), colour=(200, 10, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


def _jpeg(size=(40, 30), exif_orientation=None) -> bytes:
    from PIL import Image

    img = Image.new("RGB", size, (10, 200, 10))
    buf = io.BytesIO()
    if exif_orientation:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        img.save(buf, format="JPEG", exif=exif)
    else:
        img.save(buf, format="JPEG")
    return buf.getvalue()


def _noisy_jpeg(size=(160, 120)) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def test_every_bad_input_class_is_rejected_with_its_reason(tmp_path):
    d = tmp_path / "in"
    (d / "m").mkdir(parents=True)
    files = {
        "ok.jpg": _jpeg(), "ok2.png": _png(), "ok.wav": _tone_wav(440, 0.25),
        "trunc.jpg": _noisy_jpeg()[:9000],  # cut inside the entropy-coded scan
        "trunc.wav": _tone_wav(440, 0.5)[:4000],
        "garbage.png": b"this is not an image at all" * 10, "garbage.mp4": b"\x00not a video" * 50,
        "png_named.jpg": _png(), "notes.xyz": b"hello", "empty.png": b"", "big.png": _png((400, 400)) + b"\0" * 20000,
    }
    for name, data in files.items():
        (d / "m" / name).write_bytes(data)
    (tmp_path / "secret.jpg").write_bytes(_jpeg())
    lines = [
        json.dumps({"id": "a", "image": "m/ok.jpg", "caption": "fine"}),                    # 1 ok
        json.dumps({"id": "b", "image": "m/missing.jpg", "caption": "x"}),                  # 2 missing_file
        json.dumps({"id": "c", "image": "m/trunc.jpg", "caption": "x"}),                    # 3 truncated_media
        json.dumps({"id": "d", "audio": "m/trunc.wav", "text": "x"}),                       # 4 truncated_media
        json.dumps({"id": "e", "image": "m/garbage.png", "caption": "x"}),                  # 5 unreadable_media
        json.dumps({"id": "f", "image": "m/png_named.jpg", "caption": "x"}),                # 6 wrong_extension
        json.dumps({"id": "g", "image": "m/notes.xyz", "caption": "x"}),                    # 7 wrong_extension
        json.dumps({"id": "h", "image": "m/empty.png", "caption": "x"}),                    # 8 empty_file
        json.dumps({"id": "i", "image": "m/big.png", "caption": "x"}),                      # 9 too_large
        json.dumps({"id": "a", "image": "m/ok2.png", "caption": "dup"}),                    # 10 duplicate_id
        '{"id": "k", "image": "m/ok.jpg", "caption": ',                                     # 11 malformed_line
        json.dumps(["not", "an", "object"]),                                                # 12 malformed_line
        json.dumps({"id": "m", "image": "../secret.jpg", "caption": "x"}),                  # 13 outside_path
        json.dumps({"id": "n", "image": str(tmp_path / "secret.jpg"), "caption": "x"}),     # 14 outside_path
        json.dumps({"id": "o", "image": "m/ok2.png"}),                                      # 15 no_text
        json.dumps({"id": "p", "caption": "only words"}),                                   # 16 no_media
        json.dumps({"id": "q", "video": "m/garbage.mp4", "caption": "x"}),                  # 17 unreadable_media
        json.dumps({"id": "r", "audio": "m/ok.wav", "text": "a tone"}),                     # 18 ok
        "",                                                                                 # blank: not a record
        json.dumps({"id": "s", "images": ["m/ok.jpg", "m/ok2.png"], "caption": "two"}),     # 20 ok
        json.dumps({"id": "t", "image": "m/ok.jpg", "caption": 5}),                         # 21 bad_field
    ]
    manifest = d / "manifest.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    assert prep(manifest, out, "--max-file-mb", "0.01", "--val-ratio", "0") == 0
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    got = {r["line"]: r["code"] for r in rejects}
    assert got == {2: "missing_file", 3: "truncated_media", 4: "truncated_media", 5: "unreadable_media",
                   6: "wrong_extension", 7: "wrong_extension", 8: "empty_file", 9: "too_large",
                   10: "duplicate_id", 11: "malformed_line", 12: "malformed_line", 13: "outside_path",
                   14: "outside_path", 15: "no_text", 16: "no_media", 17: "unreadable_media", 21: "bad_field"}
    by_line = {r["line"]: r for r in rejects}
    assert by_line[11]["record"] == lines[10] and "m/missing.jpg" in by_line[2]["reason"]
    assert "--allow-outside" in by_line[13]["reason"] and "first used at" in by_line[10]["reason"]
    assert all(r["source"] == str(manifest) for r in rejects)
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    assert counts["rows_read"] == 20 == counts["written"] + counts["rejected"]
    assert counts["written"] == 3 and counts["rejected"] == 17
    assert main(["verify", str(out)]) == 0

    # --allow-outside lets the two escaping rows in; --fix-extensions stores the PNG named .jpg as .png
    out2 = tmp_path / "out2"
    assert prep(manifest, out2, "--max-file-mb", "0.01", "--val-ratio", "0", "--allow-outside",
                "--fix-extensions") == 0
    codes = {json.loads(line)["line"] for line in (out2 / "rejects.jsonl").read_text().splitlines()}
    assert not codes & {6, 13, 14}


def _png_chunks(data: bytes) -> dict[bytes, tuple[int, int]]:
    """Chunk type -> (offset of its length field, data length), first of each type."""
    import struct

    found, pos = {}, 8
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        found.setdefault(data[pos + 4:pos + 8], (pos, length))
        pos += 12 + length
    return found


def test_quick_image_checks_catch_truncated_and_corrupt_files(tmp_path):
    """Kept JPEGs are decoded at 1/8 scale and kept PNGs checked chunk by chunk (CRC-32) instead of being
    inflated: files cut short or damaged after they were written are still rejected. A PNG whose encoder
    wrote a broken pixel stream with correct CRCs passes that check; --full-decode rejects it too."""
    import struct
    import zlib

    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(1).integers(0, 256, (90, 120, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    png = buf.getvalue()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90, progressive=True)
    progressive = buf.getvalue()
    pos, length = _png_chunks(png)[b"IDAT"]
    flipped = bytearray(png)
    flipped[pos + 8 + length // 2] ^= 0xFF  # a changed byte inside IDAT: its CRC no longer matches
    rewritten = bytearray(flipped)  # the same damage with the CRC recomputed, as a faulty encoder would write
    rewritten[pos + 8 + length:pos + 12 + length] = struct.pack(">I", zlib.crc32(flipped[pos + 4:pos + 8 + length]))
    files = {"ok.png": png, "ok.jpg": progressive, "scan_cut.jpg": _noisy_jpeg()[:9000],
             "progressive_cut.jpg": progressive[:len(progressive) * 2 // 3], "no_eoi.jpg": _noisy_jpeg()[:-2],
             "idat_flipped.png": bytes(flipped), "idat_cut.png": png[:pos + 8 + length // 2],
             "no_iend.png": png[:_png_chunks(png)[b"IEND"][0]], "iend_cut.png": png[:-3],
             "encoder_bug.png": bytes(rewritten)}
    d = tmp_path / "in"
    d.mkdir()
    for name, data in files.items():
        (d / name).write_bytes(data)
    manifest = d / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": n.replace(".", "_"), "image": n, "caption": "x"}) + "\n"
                                for n in files))
    expect = {"scan_cut_jpg": "truncated_media", "progressive_cut_jpg": "truncated_media",
              "no_eoi_jpg": "truncated_media", "idat_flipped_png": "unreadable_media",
              "idat_cut_png": "truncated_media", "no_iend_png": "truncated_media", "iend_cut_png": "truncated_media"}
    for extra, also in (((), {}), (("--full-decode",), {"encoder_bug_png": "unreadable_media"})):
        out = tmp_path / f"out{len(extra)}"
        assert prep(manifest, out, "--val-ratio", "0", *extra) == 0
        rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
        assert {json.loads(r["record"])["id"]: r["code"] for r in rejects} == {**expect, **also}
        assert json.loads((out / "manifest.json").read_text())["counts"]["written"] == 3 - len(also)


def test_all_rows_rejected_is_an_error_that_points_at_the_rejects(tmp_path, capsys):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"image": "nope.jpg", "caption": "x"}) + "\n")
    assert prep(manifest, tmp_path / "out", "--val-ratio", "0") == 2
    assert "rejects.jsonl" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "rejects.jsonl").read_text())["code"] == "missing_file"


def test_folder_input_with_txt_captions(tmp_path):
    d = tmp_path / "pics"
    (d / "sub").mkdir(parents=True)
    (d / "a.jpg").write_bytes(_jpeg())
    (d / "a.txt").write_text("a green box\n")
    (d / "sub" / "b.png").write_bytes(_png())
    (d / "sub" / "b.txt").write_text("a red box")
    (d / "c.png").write_bytes(_png())            # no caption
    (d / "orphan.txt").write_text("no picture")  # no media
    (d / ".DS_Store").write_bytes(b"junk")       # hidden: skipped
    out = tmp_path / "out"
    assert prep(d, out, "--val-ratio", "0") == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["sample_type"] == "captioning" and m["counts"]["written"] == 2
    codes = sorted(json.loads(line)["code"] for line in (out / "rejects.jsonl").read_text().splitlines())
    assert codes == ["no_media", "no_text"]
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    ds = get_train_dataset(str(out), batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                           worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0), repeat=False)
    assert sorted((s.__key__, s.caption) for s in get_loader(ds)) == [("a", "a green box"), ("sub_b", "a red box")]
    webp = tmp_path / "webp"  # re-encoded sets load the same way (energon decodes .webp too)
    assert prep(d, webp, "--val-ratio", "0", "--image-format", "webp") == 0
    ds = get_train_dataset(str(webp), batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                           worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0), repeat=False)
    assert sorted(tuple(s.image.shape) for s in get_loader(ds)) == [(3, 30, 40), (3, 30, 40)]


def test_image_reencode_applies_exif_and_max_side_and_audio_resamples(tmp_path):
    import tarfile

    d = tmp_path / "in"
    d.mkdir()
    (d / "rot.jpg").write_bytes(_jpeg((80, 40), exif_orientation=6))  # stored landscape, shown portrait
    (d / "tone.wav").write_bytes(_tone_wav(440, 1.0))
    stereo = io.BytesIO()
    with wave.open(stereo, "wb") as w:
        w.setnchannels(2), w.setsampwidth(2), w.setframerate(22050)
        w.writeframes(b"\x10\x00\xf0\xff" * 22050)
    (d / "stereo.wav").write_bytes(stereo.getvalue())
    manifest = d / "m.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in [
        {"id": "rot", "image": "rot.jpg", "caption": "x"},
        {"id": "tone", "audio": "tone.wav", "text": "x"},
        {"id": "stereo", "audio": "stereo.wav", "text": "x"}]) + "\n")
    out = tmp_path / "out"
    assert prep(manifest, out, "--image-format", "png", "--max-side", "32", "--audio-rate", "8000", "--mono",
                "--val-ratio", "0") == 0
    members = {}
    for shard in sorted(out.glob("shard-*.tar")):
        with tarfile.open(shard) as tar:
            members.update({m.name: tar.extractfile(m).read() for m in tar})
    from PIL import Image

    img = Image.open(io.BytesIO(members["rot.png"]))
    assert img.format == "PNG" and img.size == (16, 32)  # rotated upright, longer side 32
    for key, seconds in (("tone", 1.0), ("stereo", 1.0)):
        with wave.open(io.BytesIO(members[f"{key}.wav"])) as w:
            assert w.getframerate() == 8000 and w.getnchannels() == 1
            assert abs(w.getnframes() / 8000 - seconds) < 0.01
        meta = json.loads(members[f"{key}.json"])
        assert meta["audio"]["sample_rate"] == 8000 and abs(meta["audio"]["duration"] - seconds) < 0.01
    assert json.loads(members["rot.json"])["images"][0]["source_size"] == [80, 40]


def test_bad_options_are_clear_errors(tmp_path, capsys):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("")
    assert prep(manifest, tmp_path / "o", "--shard-size", "lots") == 2
    assert "--shard-size" in capsys.readouterr().err
    assert prep(tmp_path / "missing.jsonl", tmp_path / "o") == 2
    assert "no such file" in capsys.readouterr().err
    assert prep(manifest, tmp_path / "o", "--val-ratio", "1.5") == 2


def test_several_manifests_derived_ids_forced_captioning_and_overwrite(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "x.jpg").write_bytes(_jpeg())
    (d / "t.wav").write_bytes(_tone_wav(440, 0.25))
    (d / "a.jsonl").write_text(json.dumps({"image": "x.jpg", "caption": "from a"}) + "\n")
    (d / "b.jsonl").write_text(json.dumps({"image": "x.jpg", "text": "from b"}) + "\n"
                               + json.dumps({"audio": "t.wav", "text": "a tone"}) + "\n")
    out = tmp_path / "out"
    assert prep([d / "a.jsonl", d / "b.jsonl"], out, "--val-ratio", "0", "--sample-type", "captioning") == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["sample_type"] == "captioning" and m["counts"]["written"] == 2 and m["counts"]["rows_read"] == 3
    (reject,) = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert reject["code"] == "bad_field" and "--sample-type crude" in reject["reason"]
    assert reject["source"] == str(d / "b.jsonl") and reject["line"] == 2
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    ds = get_train_dataset(str(out), batch_size=None, shuffle_buffer_size=None, max_samples_per_sequence=None,
                           worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0), repeat=False)
    assert sorted((s.__key__, s.caption) for s in get_loader(ds)) == [("a-00000001", "from a"),
                                                                       ("b-00000001", "from b")]
    assert prep([d / "b.jsonl"], out, "--val-ratio", "0") == 2  # previous output: refused without a flag
    assert prep([d / "b.jsonl"], out, "--val-ratio", "0", "--overwrite") == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["sample_type"] == "crude" and m["counts"]["written"] == 2 and m["subflavor"] == "mixed"
    assert prep(d, d / "shards") == 2  # output inside the input folder would feed on itself


def test_overwrite_keeps_the_earlier_output_whole_until_the_new_one_is_complete(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "x.jpg").write_bytes(_jpeg())
    (d / "good.jsonl").write_text(json.dumps({"image": "x.jpg", "caption": "kept"}) + "\n")
    (d / "bad.jsonl").write_text(json.dumps({"image": "missing.jpg", "caption": "no file"}) + "\n")
    out = tmp_path / "out"
    (out / "notes.txt").parent.mkdir()
    (out / "notes.txt").write_text("the user's own file")
    assert prep([d / "good.jsonl"], out, "--val-ratio", "0") == 0
    earlier = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert prep([d / "bad.jsonl"], out, "--val-ratio", "0", "--overwrite") == 2  # every row rejected: fails
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()
            and ".overwrite-build" not in p.parts} == earlier
    assert prep([d / "good.jsonl", d / "bad.jsonl"], out, "--val-ratio", "0", "--overwrite") == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"] == {**m["counts"], "rows_read": 2, "written": 1, "rejected": 1}
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".overwrite")) == []
    assert (out / "notes.txt").read_text() == "the user's own file"
    assert main(["verify", str(out)]) == 0
