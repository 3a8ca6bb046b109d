"""Deterministic tar shards and the megatron-energon metadata that makes them loadable as they are.

Byte-identical output for the same input and options comes from three choices:
- every tar header is fixed (ustar, mtime 0, uid/gid 0, empty user/group names, mode 0644) and a sample's
  members are written in sorted name order;
- samples arrive in manifest order (the pool hands results back in order) and each split's shard boundary
  is a function of the ordered sample sizes only: a shard is closed when the next sample would push it past
  ``--shard-size`` (a sample bigger than that gets a shard of its own);
- train and val samples go to their own shard sequences, ``shard-train-NNNNNN.tar`` and
  ``shard-val-NNNNNN.tar``, because energon splits a dataset by shard file.

A shard is written as ``.NAME.tmp`` and renamed when complete, so a crash never leaves a torn shard.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import struct
import tarfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from mmtrain.utils.atomic import atomic_open, atomic_write_text, fsync_dir

BLOCK = 512
RECORD = 20 * BLOCK  # tar's customary record size; the archive is padded to it like GNU tar does
SPLITS = ("train", "val")
NV_META = ".nv-meta"
IMAGE_FIELD_MAP = "jpg,png,webp,gif,bmp,tiff"


def shard_name(split: str, index: int) -> str:
    return f"shard-{split}-{index:06d}.tar"


def _padded(n: int) -> int:
    return (n + BLOCK - 1) // BLOCK * BLOCK


def sample_tar_bytes(parts: dict[str, bytes]) -> int:
    """Exact number of bytes a sample occupies in a shard (a header block per member + padded data)."""
    return sum(BLOCK + _padded(len(v)) for v in parts.values())


def _tarfile_header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


# Every header is the same ustar block but for the name, the size and the checksum, so the common case is
# filled into a template (~20x faster than tarfile.TarInfo.tobuf, which stays the reference and the fallback
# for names that need ustar's prefix field; a test checks both give the same bytes).
_TEMPLATE = bytearray(_tarfile_header("x", 0))
_TEMPLATE[0:1] = b"\0"
_TEMPLATE[124:136] = b"\0" * 12
_TEMPLATE[148:156] = b" " * 8  # the checksum is summed with its own field as spaces
_TEMPLATE_SUM = sum(_TEMPLATE)
_MAX_USTAR_SIZE = 8**11 - 1


def _header(name: str, size: int) -> bytes:
    raw = name.encode("utf-8")
    if len(raw) > 100 or not 0 <= size <= _MAX_USTAR_SIZE:
        return _tarfile_header(name, size)
    size_field = b"%011o\0" % size
    block = bytearray(_TEMPLATE)
    block[0:len(raw)] = raw
    block[124:136] = size_field
    block[148:156] = b"%06o\0 " % (_TEMPLATE_SUM + sum(raw) + sum(size_field))
    return bytes(block)


@dataclass
class ShardRecord:
    """A complete shard as recorded in the run state and in manifest.json."""

    name: str
    split: str
    samples: int
    bytes: int
    sha256: str
    data_bytes: int = 0
    modalities: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)


class _OpenShard:
    def __init__(self, out_dir: Path, name: str, split: str):
        self.name, self.split = name, split
        self.final = out_dir / name
        self.tmp = out_dir / f".{name}.tmp"
        self.f = open(self.tmp, "wb")
        self.hash = hashlib.sha256()
        self.offset = 0
        self.samples = 0
        self.data_bytes = 0
        self.modalities: dict[str, int] = {}
        self.index: list[ScannedSample] = []  # what scan_shard would read back, known without reading

    def _write(self, b: bytes) -> None:
        self.f.write(b)
        self.hash.update(b)
        self.offset += len(b)

    def add(self, key: str, parts: dict[str, bytes], modality: str) -> None:
        sample = ScannedSample(key, self.offset, 0, [])
        for part in sorted(parts):
            data = parts[part]
            self._write(_header(f"{key}.{part}", len(data)))
            sample.parts.append((part, self.offset, len(data)))
            self._write(data)
            pad = _padded(len(data)) - len(data)
            if pad:
                self._write(b"\0" * pad)
            self.data_bytes += len(data)
        sample.size = self.offset - sample.offset
        self.index.append(sample)
        self.samples += 1
        self.modalities[modality] = self.modalities.get(modality, 0) + 1

    def close(self) -> ShardRecord:
        self.end = self.offset
        end = self.offset + 2 * BLOCK
        self._write(b"\0" * (_padded_record(end) - self.offset))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.final)
        fsync_dir(self.final.parent)
        return ShardRecord(self.name, self.split, self.samples, self.offset, self.hash.hexdigest(),
                           self.data_bytes, dict(sorted(self.modalities.items())))

    def abandon(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def _padded_record(n: int) -> int:
    return (n + RECORD - 1) // RECORD * RECORD


class ShardSetWriter:
    """Appends samples to the shard sequence of their split; calls ``on_shard`` with each completed shard."""

    def __init__(self, out_dir: Path, shard_size: int, start_index: dict[str, int], on_shard):
        self.out_dir, self.shard_size, self.on_shard = out_dir, shard_size, on_shard
        self.next_index = {s: start_index.get(s, 0) for s in SPLITS}
        self.open: dict[str, _OpenShard | None] = {s: None for s in SPLITS}
        self.index: dict[str, tuple[list[ScannedSample], int]] = {}  # shard name -> (samples, end offset)

    def add(self, split: str, key: str, parts: dict[str, bytes], modality: str) -> None:
        size = sample_tar_bytes(parts)
        cur = self.open[split]
        if cur is not None and cur.samples and cur.offset + size > self.shard_size:
            self._close(split)
            cur = None
        if cur is None:
            cur = self.open[split] = _OpenShard(self.out_dir, shard_name(split, self.next_index[split]), split)
            self.next_index[split] += 1
        cur.add(key, parts, modality)

    def _close(self, split: str) -> None:
        cur = self.open[split]
        self.open[split] = None
        if cur is not None:
            rec = cur.close()
            self.index[rec.name] = (cur.index, cur.end)
            self.on_shard(rec)

    def finish(self) -> None:
        for split in SPLITS:
            self._close(split)

    def abandon(self) -> None:
        for split in SPLITS:
            if self.open[split] is not None:
                self.open[split].abandon()
                self.open[split] = None


# --------------------------------------------------------------------------------------- reading back

@dataclass
class ScannedSample:
    key: str
    offset: int
    size: int
    parts: list[tuple[str, int, int]]  # (part name, data offset, data size)


def scan_shard(path: Path) -> tuple[list[ScannedSample], int]:
    """Samples of a shard from its tar headers (data is skipped, not read), and the end offset of the
    last member: the same walk energon's own indexer does, so the index we write is the one it would."""
    samples: list[ScannedSample] = []
    with tarfile.open(path, "r:") as tar:
        for m in tar:
            if not m.isreg():
                continue
            base, _, part = m.name.partition(".")
            if not samples or samples[-1].key != base:
                samples.append(ScannedSample(base, m.offset, 0, []))
            samples[-1].parts.append((part, m.offset_data, m.size))
        end = tar.offset
    for s, nxt in zip(samples, samples[1:] + [None]):
        s.size = (nxt.offset if nxt is not None else end) - s.offset
    return samples, end


def write_tar_index(path: Path, samples: list[ScannedSample], end: int) -> None:
    """``NAME.tar.idx`` next to the shard: little-endian uint64 start offset of every sample, then the end."""
    offsets = [s.offset for s in samples] + [end]
    with atomic_open(path.with_suffix(".tar.idx"), "wb") as f:
        f.write(struct.pack(f"<{len(offsets)}Q", *offsets))


# The index.sqlite layout energon 7 reads (tables `samples` and `sample_parts` with their lookup indexes).
# Written with the standard sqlite3 module rather than energon's writer because importing megatron.energon
# pulls in torch (~1.7 s and ~600 MB per run); test_prep_media checks this schema against energon's own.
_SQLITE_SCHEMA = (
    "CREATE TABLE samples (tar_file_id INTEGER NOT NULL, sample_key TEXT NOT NULL UNIQUE, "
    "sample_index INTEGER NOT NULL, byte_offset INTEGER, byte_size INTEGER)",
    "CREATE TABLE sample_parts (tar_file_id INTEGER, sample_index INTEGER, part_name TEXT, "
    "content_byte_offset INTEGER, content_byte_size INTEGER)",
)
_SQLITE_INDEXES = (
    "CREATE INDEX idx_samples_by_tar_and_idx ON samples(tar_file_id, sample_index)",
    "CREATE INDEX idx_sample_parts_seq ON sample_parts(tar_file_id, sample_index, content_byte_offset)",
    "CREATE INDEX idx_sample_parts_full ON sample_parts(tar_file_id, sample_index, part_name, "
    "content_byte_offset, content_byte_size)",
)


def _write_sqlite(meta_dir: Path, shard_scans: list[tuple[str, list[ScannedSample]]]) -> None:
    """``.nv-meta/index.sqlite``: every sample's key, shard and byte range, and every part's byte range."""
    final = meta_dir / "index.sqlite"
    tmp = meta_dir / ".index.sqlite.tmp"
    tmp.unlink(missing_ok=True)
    db = sqlite3.connect(tmp)
    try:
        for stmt in _SQLITE_SCHEMA:
            db.execute(stmt)
        for tar_id, (_, samples) in enumerate(shard_scans):
            db.executemany("INSERT INTO samples VALUES (?, ?, ?, ?, ?)",
                           ((tar_id, s.key, i, s.offset, s.size) for i, s in enumerate(samples)))
            db.executemany("INSERT INTO sample_parts VALUES (?, ?, ?, ?, ?)",
                           ((tar_id, i, p, off, size) for i, s in enumerate(samples) for p, off, size in s.parts))
        for stmt in _SQLITE_INDEXES:
            db.execute(stmt)
        db.commit()
    finally:
        db.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)  # sqlite created the file with the umask's mode


def _energon_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("megatron-energon")
    except Exception:  # noqa: BLE001 - only recorded for information
        return None


def dataset_yaml(sample_type: str, subflavor: str) -> str:
    """``captioning``: energon ``CaptioningSample`` (image + txt); ``crude``: ``CrudeWebdataset`` samples
    (plain dicts of raw parts) that mmtrain's task encoder cooks, tagged with a subflavor to pick the cooker."""
    if sample_type == "captioning":
        return ("sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
                f"field_map:\n  image: {IMAGE_FIELD_MAP}\n  caption: txt\n")
    return (f"__module__: megatron.energon\n__class__: CrudeWebdataset\nsubflavors:\n"
            f"  mmtrain_media: {subflavor}\n")


def write_energon_meta(out_dir: Path, shards: list[ShardRecord], sample_type: str, subflavor: str,
                       known: dict[str, tuple[list[ScannedSample], int]] | None = None) -> None:
    """Everything energon reads in ``.nv-meta/`` plus the per-shard ``.tar.idx`` files energon keeps next to
    each tar. Written by us (no separate ``energon prepare``), deterministically: the dataset uuid is derived
    from the shard checksums instead of drawn at random. ``known``: sample positions the writer recorded
    (shard name -> (samples, end)); other shards (done before a --resume) are read back with scan_shard."""
    meta_dir = out_dir / NV_META
    meta_dir.mkdir(exist_ok=True)
    ordered = sorted(shards, key=lambda s: (SPLITS.index(s.split), s.name))
    scans = []
    for rec in ordered:
        samples, end = (known or {}).get(rec.name) or scan_shard(out_dir / rec.name)
        write_tar_index(out_dir / rec.name, samples, end)
        scans.append((rec.name, samples))
    _write_sqlite(meta_dir, scans)
    info = {"energon_version": _energon_version(), "shard_counts": {r.name: r.samples for r in ordered}}
    atomic_write_text(meta_dir / ".info.json", json.dumps(info, indent=2) + "\n")
    lines = ["split_parts:"]
    for split in SPLITS:
        names = [r.name for r in ordered if r.split == split]
        lines.append(f"  {split}:" + ("" if names else " []"))
        lines.extend(f"  - {n}" for n in names)
    lines.append("exclude: []")
    atomic_write_text(meta_dir / "split.yaml", "\n".join(lines) + "\n")
    atomic_write_text(meta_dir / "dataset.yaml", dataset_yaml(sample_type, subflavor))
    atomic_write_text(meta_dir / "crude.yaml", dataset_yaml("crude", subflavor))
    digest = hashlib.sha256("".join(f"{r.name}:{r.sha256}\n" for r in ordered).encode()).hexdigest()
    atomic_write_text(meta_dir / "index.uuid", str(uuid.uuid5(uuid.NAMESPACE_URL, "mmtrain-prep:" + digest)))
