"""`mmtrain-prep text` on Parquet files and `datasets.save_to_disk` folders: the same bytes as from JSONL,
bad rows as rejects naming file, row group and row, hostile dataset folders refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from dataprep.cli import main as prep  # noqa: E402
from tests.unit.test_prep_text import DOCS, write_jsonl  # noqa: E402
from tests.unit.test_tokenizer import build_sentencepiece  # noqa: E402


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return build_sentencepiece(tmp_path_factory.mktemp("sp"))


def write_parquet(path: Path, columns: dict, row_group_size: int = 64, schema=None) -> Path:
    pq.write_table(pa.table(columns, schema=schema), path, row_group_size=row_group_size)
    return path


def save_to_disk_layout(folder: Path, columns: dict, shards: int = 2) -> Path:
    """The folder `datasets.Dataset.save_to_disk` writes: Arrow IPC stream shards, state.json, dataset_info.json.
    Written with `datasets` itself when it is installed."""
    try:
        import datasets
    except ImportError:
        datasets = None
    if datasets is not None:
        datasets.Dataset.from_dict(columns).save_to_disk(str(folder), num_shards=shards)
        return folder
    folder.mkdir(parents=True)
    table = pa.table(columns)
    n = table.num_rows
    names = []
    for s in range(shards):
        part = table.slice(s * n // shards, (s + 1) * n // shards - s * n // shards)
        name = f"data-{s:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, part.schema) as writer:
            for batch in part.to_batches(max_chunksize=50):
                writer.write_batch(batch)
        names.append(name)
    (folder / "state.json").write_text(json.dumps({
        "_data_files": [{"filename": n} for n in names], "_fingerprint": "0123456789abcdef",
        "_format_columns": None, "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False,
        "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({
        "citation": "", "description": "", "homepage": "", "license": "",
        "features": {k: {"dtype": "string", "_type": "Value"} for k in columns}}))
    return folder


def run_text(inp, prefix, sp_model, *extra) -> int:
    return prep(["text", "--input", *map(str, inp if isinstance(inp, list) else [inp]), "--output-prefix",
                 str(prefix), "--tokenizer", str(sp_model), "--append-eod", "--block-mb", "0.002", *extra])


def outputs(prefix) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


def rejects(prefix) -> list[dict]:
    path = Path(f"{prefix}.rejects.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.parametrize("workers", ["0", "2"])
def test_parquet_and_save_to_disk_equal_jsonl_bytes(tmp_path, sp_model, workers):
    titles = [f"title {i}" for i in range(len(DOCS))]
    write_jsonl(tmp_path / "in.jsonl", DOCS, title="title ")
    cols = {"id": list(range(len(DOCS))), "text": DOCS, "title": titles}
    write_parquet(tmp_path / "in.parquet", cols)
    save_to_disk_layout(tmp_path / "ds", cols)
    for keys in (["text"], ["text", "title"]):
        got = {}
        for name, inp in (("jsonl", tmp_path / "in.jsonl"), ("parquet", tmp_path / "in.parquet"),
                          ("hf", tmp_path / "ds")):
            prefix = tmp_path / f"{name}{len(keys)}"
            assert run_text(inp, prefix, sp_model, "--workers", workers, "--json-keys", *keys) == 0
            got[name] = [outputs(prefix if len(keys) == 1 else f"{prefix}_{k}") for k in keys]
            m = json.loads(Path(f"{prefix}.manifest.json").read_text())
            assert m["documents"]["read"] == len(DOCS) and m["documents"]["rejected"] == 0
            assert all(i["sha256"] and i["records"] for i in m["inputs"])
            assert sum(i["records"] for i in m["inputs"]) == len(DOCS)
            assert prep(["verify", str(prefix)]) == 0  # counts, sizes and checksums reconcile
        assert got["jsonl"] == got["parquet"] == got["hf"]
    assert pq.ParquetFile(tmp_path / "in.parquet").metadata.num_row_groups > 3  # several groups, several blocks


def test_bad_rows_become_rejects_naming_row_group_and_row(tmp_path, sp_model):
    n = 130
    texts = [f"good document {i}" for i in range(n)]
    texts[5] = None
    raw = [t.encode() if t is not None else b"x" for t in texts]
    raw[70] = b"bad \xff\xfe utf-8"
    write_parquet(tmp_path / "a.parquet", {"text": texts, "body": pa.array(raw, pa.binary()),
                                           "num": list(range(n))})
    prefix = tmp_path / "o"
    assert run_text(tmp_path / "a.parquet", prefix, sp_model, "--workers", "0") == 0
    r = rejects(prefix)
    assert [(x["row_group"], x["row"], x["code"]) for x in r] == [(0, 5, "null_value")]
    assert r[0]["file"].endswith("a.parquet") and "column 'text' is null" in r[0]["reason"]

    assert run_text(tmp_path / "a.parquet", prefix, sp_model, "--workers", "0", "--json-keys", "body") == 0
    r = rejects(prefix)
    assert [(x["row_group"], x["row"], x["code"]) for x in r] == [(1, 70, "invalid_utf8")]
    assert "bad \\xff\\xfe" in r[0]["excerpt"]

    # a number column and a missing column: every row rejected -> nothing written, one-line error
    assert run_text(tmp_path / "a.parquet", prefix, sp_model, "--workers", "0", "--json-keys", "num") == 2
    assert {x["code"] for x in rejects(tmp_path / "o.failed")} == {"not_a_string"}
    assert run_text(tmp_path / "a.parquet", prefix, sp_model, "--workers", "0", "--json-keys", "nope") == 2
    assert {x["code"] for x in rejects(tmp_path / "o.failed")} == {"missing_key"}


def test_strict_names_file_row_group_and_row(tmp_path, sp_model, capsys):
    write_parquet(tmp_path / "a.parquet", {"text": ["ok"] * 100 + [None]}, row_group_size=40)
    assert run_text(tmp_path / "a.parquet", tmp_path / "o", sp_model, "--workers", "0", "--strict") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a.parquet: row group 2, row 100: column 'text' is null" in err[0]
    assert "Traceback" not in "\n".join(err)


def test_cut_short_parquet_is_a_reject_and_the_other_files_are_read(tmp_path, sp_model):
    write_parquet(tmp_path / "a.parquet", {"text": [f"doc {i}" for i in range(50)]})
    data = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "b.parquet").write_bytes(data[: len(data) // 2])  # no footer
    write_jsonl(tmp_path / "c.jsonl", ["tail doc"])
    prefix = tmp_path / "o"
    assert run_text(tmp_path, prefix, sp_model, "--workers", "0", "--progress", "always") == 0
    r = rejects(prefix)
    assert [(Path(x["file"]).name, x["row"], x["code"]) for x in r] == [("b.parquet", 0, "truncated_file")]
    m = json.loads(Path(f"{prefix}.manifest.json").read_text())
    assert [Path(i["path"]).name for i in m["inputs"]] == ["a.parquet", "b.parquet", "c.jsonl"]
    assert m["documents"]["written"] == 51


def _corrupt_row_group(path: Path, group: int) -> None:
    """Overwrite the compressed pages of one row group's first column (the footer stays intact)."""
    column = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + 40:start + column.total_compressed_size - 10] = b"\xab" * (column.total_compressed_size - 50)
    path.write_bytes(bytes(data))


def test_corrupt_middle_row_group_is_rejected_rows_and_the_next_group_is_read(tmp_path, sp_model):
    texts = [f"document number {i} " + "word " * (i % 7) for i in range(3000)]
    write_parquet(tmp_path / "a.parquet", {"text": texts}, row_group_size=1000)
    _corrupt_row_group(tmp_path / "a.parquet", 1)
    write_parquet(tmp_path / "kept.parquet", {"text": texts[:1000] + texts[2000:]}, row_group_size=1000)
    prefix = tmp_path / "o"
    assert run_text(tmp_path / "a.parquet", prefix, sp_model, "--workers", "0") == 0
    m = json.loads(Path(f"{prefix}.manifest.json").read_text())
    # every row of the file is accounted for: rows of the groups before and after are written, the lost ones rejected
    assert m["documents"] == {"read": 3000, "written": 2000, "empty": 0, "rejected": 1000, "blank_lines": 0}
    assert m["inputs"][0]["records"] == 3000 and m["rejects_by_code"] == {"corrupt_row_group": 1000}
    r = rejects(prefix)
    assert [(x["row_group"], x["row"], x["rows"], x["code"]) for x in r] == [(1, 1000, 1000, "corrupt_row_group")]
    assert "rows 1000 to 1999 (1,000) could not be read" in r[0]["reason"]
    assert run_text(tmp_path / "kept.parquet", tmp_path / "kept", sp_model, "--workers", "0") == 0
    assert outputs(prefix) == outputs(tmp_path / "kept")  # row group 2 was read on, in order
    assert prep(["verify", str(prefix)]) == 0


def test_folder_walk_reads_datasets_folders_in_their_shard_order(tmp_path, sp_model):
    save_to_disk_layout(tmp_path / "root" / "ds", {"text": [f"hf {i}" for i in range(20)]}, shards=3)
    # state.json lists the shards in the dataset's order, not the names' order
    state = json.loads((tmp_path / "root" / "ds" / "state.json").read_text())
    state["_data_files"].reverse()
    (tmp_path / "root" / "ds" / "state.json").write_text(json.dumps(state))
    write_jsonl(tmp_path / "root" / "a.jsonl", ["first"])
    prefix = tmp_path / "o"
    assert run_text(tmp_path / "root", prefix, sp_model, "--workers", "0", "--progress", "always") == 0
    m = json.loads(Path(f"{prefix}.manifest.json").read_text())
    names = [Path(i["path"]).name for i in m["inputs"]]
    assert names == ["a.jsonl"] + [d["filename"] for d in state["_data_files"]]
    assert m["skipped_inputs"] == []  # state.json / dataset_info.json are the dataset's, not records


@pytest.mark.parametrize("filename", ["../x.arrow", "/etc/passwd", "sub/x.arrow", 7])
def test_hostile_state_json_is_refused(tmp_path, sp_model, capsys, filename):
    folder = save_to_disk_layout(tmp_path / "ds", {"text": ["a", "b"]}, shards=1)
    (tmp_path / "x.arrow").write_bytes((folder / "data-00000-of-00001.arrow").read_bytes())
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": filename}]}))
    assert run_text(folder, tmp_path / "o", sp_model, "--workers", "0") == 2
    err = capsys.readouterr().err
    assert "state.json" in err and "Traceback" not in err


def test_dataset_dict_asks_for_a_split(tmp_path, sp_model, capsys):
    try:
        import datasets
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})}).save_to_disk(str(tmp_path / "dd"))
    except ImportError:
        save_to_disk_layout(tmp_path / "dd" / "train", {"text": ["a"]}, shards=1)
        (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    assert run_text(tmp_path / "dd", tmp_path / "o", sp_model, "--workers", "0") == 2
    assert f"--input {tmp_path / 'dd' / 'train'}" in capsys.readouterr().err


def test_train_tokenizer_reads_parquet(tmp_path, capsys):
    write_parquet(tmp_path / "a.parquet", {"text": [f"some words number {i} again" for i in range(200)] + [None]})
    assert prep(["train-tokenizer", "--input", str(tmp_path / "a.parquet"), "--output-prefix", str(tmp_path / "t"),
                 "--vocab-size", "300", "--threads", "1"]) == 0
    assert (tmp_path / "t.model").is_file()
    assert "a.parquet: row group 3, row 200: column 'text' is null" in capsys.readouterr().err


def test_every_string_column_type_gives_the_same_bytes(tmp_path, sp_model):
    docs = DOCS[:40]
    got = []
    for i, array in enumerate([pa.array(docs, pa.string()), pa.array(docs, pa.large_string()),
                               pa.array(docs).dictionary_encode(), pa.array([d.encode() for d in docs], pa.binary()),
                               pa.array([d.encode() for d in docs], pa.large_binary())]):
        pq.write_table(pa.table({"text": array}), tmp_path / f"{i}.parquet", row_group_size=16)
        assert run_text(tmp_path / f"{i}.parquet", tmp_path / f"o{i}", sp_model, "--workers", "0") == 0
        got.append(outputs(tmp_path / f"o{i}"))
    assert all(g == got[0] for g in got)


def test_a_lone_state_json_is_still_a_jsonl_input(tmp_path, sp_model):
    write_jsonl(tmp_path / "d" / "state.json" if (tmp_path / "d").mkdir() is None else None, ["one", "two"])
    prefix = tmp_path / "o"
    assert run_text(tmp_path / "d", prefix, sp_model, "--workers", "0") == 0
    assert json.loads(Path(f"{prefix}.manifest.json").read_text())["documents"]["written"] == 2


def test_blocks_stay_small_and_inside_one_row_group(tmp_path):
    from dataprep.text_tables import TableBlock, table_blocks

    texts = [f"row {i} " + "x" * (i % 50) for i in range(5000)]
    write_parquet(tmp_path / "a.parquet", {"text": texts, "other": list(range(5000))}, row_group_size=1000)
    blocks = list(table_blocks(tmp_path / "a.parquet", "parquet", 0, ("text",), block_bytes=4096))
    assert all(isinstance(b, TableBlock) for b in blocks)
    assert [b.first_row for b in blocks] == [sum(x.num_rows for x in blocks[:i]) for i in range(len(blocks))]
    assert sum(b.num_rows for b in blocks) == 5000 and len({b.row_group for b in blocks}) == 5
    assert all(b.first_row // 1000 == (b.first_row + b.num_rows - 1) // 1000 == b.row_group for b in blocks)
    assert max(b.text_bytes for b in blocks) < 3 * 4096  # about --block-mb each, whatever the file's size
    assert set(blocks[0].columns) == {"text"}  # only the key columns are read


def test_a_row_the_tokenizer_refuses_is_rejected_alone():
    from dataprep.text_encode import BlockEncoder, EncodeOptions
    from dataprep.text_tables import TableBlock

    class Tok:
        eod_id = 2

        def set_threads(self, n):
            pass

        def encode_batch(self, texts):
            if any("BAD" in t for t in texts):
                raise ValueError("refused")
            return [[1] * len(t) for t in texts]

    encoder = BlockEncoder(EncodeOptions("t", None, None, False, ("text",), False, None, False, "uint16"), Tok())
    out = encoder.encode(TableBlock(0, 3, 100, 3, {"text": pa.array(["ok", "BAD one", None])}, 10))
    assert [(r.line, r.code, r.excerpt) for r in out.rejects] == [(101, "tokenizer_error", "BAD one"),
                                                                  (102, "null_value", "null")]
    assert out.row_group == 3 and out.records == 3 and out.lengths["text"].tolist() == [2]
