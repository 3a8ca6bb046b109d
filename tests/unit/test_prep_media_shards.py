"""The shard writer on its own: boundaries, order and fixed tar metadata (no media decoding, no energon)."""

from __future__ import annotations

import hashlib
import tarfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dataprep.media_shards import (
    ShardSetWriter,
    _header,
    _tarfile_header,
    sample_tar_bytes,
    scan_shard,
)

SHARD_SIZE = 20_000


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.tuples(st.integers(0, 9000), st.integers(0, 3000), st.booleans()), min_size=1, max_size=30))
def test_greedy_boundaries_keep_order_and_fixed_headers(tmp_path_factory, sizes):
    out = Path(tmp_path_factory.mktemp("shards"))
    done = []
    writer = ShardSetWriter(out, SHARD_SIZE, {}, done.append)
    samples = []
    for i, (a, b, val) in enumerate(sizes):
        parts = {"bin": bytes([i % 251]) * a, "txt": b"t" * b, "json": b"{}"}
        split = "val" if val else "train"
        writer.add(split, f"s{i:04d}", parts, "image")
        samples.append((split, f"s{i:04d}", sample_tar_bytes(parts)))
    writer.finish()
    assert not list(out.glob(".*.tmp"))
    for split in ("train", "val"):
        recs = sorted((r for r in done if r.split == split), key=lambda r: r.name)
        want = [(k, n) for s, k, n in samples if s == split]
        got = []
        for rec in recs:
            scanned, end = scan_shard(out / rec.name)
            assert writer.index[rec.name] == (scanned, end)  # recorded while writing = read back
            got.append([s.key for s in scanned])
            assert rec.samples == len(scanned) and rec.bytes == (out / rec.name).stat().st_size
            assert rec.sha256 == hashlib.sha256((out / rec.name).read_bytes()).hexdigest()
            data_end = sum(n for k, n in want if k in got[-1])
            assert end == data_end and (data_end <= SHARD_SIZE or len(scanned) == 1)
            with tarfile.open(out / rec.name) as tar:
                for m in tar:
                    assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)
        assert [k for keys in got for k in keys] == [k for k, _ in want]  # nothing lost, nothing reordered
        sizes_by_key = dict(want)
        for keys, nxt in zip(got, got[1:]):  # greedy: a shard closes only when the next sample does not fit
            assert sum(sizes_by_key[k] for k in keys) + sizes_by_key[nxt[0]] > SHARD_SIZE


@given(name=st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), min_size=1,
                    max_size=120),
       size=st.one_of(st.integers(0, 10**6), st.integers(8**11 - 2, 8**11 - 1)))
@settings(max_examples=200, deadline=None)
def test_fast_tar_header_equals_tarfile(name, size):
    def outcome(make):
        try:
            return make(name, size)
        except ValueError as exc:  # a long name ustar cannot split: both refuse it alike
            return str(exc)

    assert outcome(_header) == outcome(_tarfile_header)
