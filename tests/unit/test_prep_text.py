"""`mmtrain-prep text` end to end: lossless round trip, both tokenizer kinds, gz/zst, multi-key, merge,
inspect/verify, and the Megatron-Core reader."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dataprep.cli import main as prep
from mmtrain.core.indexed import IndexedDataset
from tests.unit.test_tokenizer import (
    TRICKY_DOCS,
    build_gpt2_files,
    build_hf_bpe,
    build_hf_wide,
    build_sentencepiece,
    gpt2_reference_encode,
)

REPO = Path(__file__).resolve().parents[2]
LONG_DOC = "A very long document with Unicode ünïcödé and 🙂 emoji. " * 3000  # ~170k characters
DOCS = TRICKY_DOCS + [LONG_DOC, "", "short", "   ", "last one"] + [f"document number {i} 東京" for i in range(300)]


def write_jsonl(path: Path, docs, key="text", opener=open, **extra) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, key: d, **{k: f"{v}{i}" for k, v in extra.items()}},
                               ensure_ascii=i % 2 == 0) + "\n")
    return path


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return build_sentencepiece(tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return build_hf_bpe(tmp_path_factory.mktemp("hf") / "tok").parent


def manifest(prefix) -> dict:
    return json.loads(Path(f"{prefix}.manifest.json").read_text())


def expected(tok, docs, eod):
    out = [tok.encode(d) + ([eod] if eod is not None else []) for d in docs if tok.encode(d)]
    return out


def test_round_trip_sentencepiece_workers(tmp_path, sp_model, capsys):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    data = write_jsonl(tmp_path / "in.jsonl", DOCS)
    results = {}
    for workers in ("0", "2"):
        prefix = tmp_path / f"out{workers}"
        assert prep(["text", "--input", str(data), "--output-prefix", str(prefix), "--tokenizer", str(sp_model),
                     "--append-eod", "--workers", workers, "--block-mb", "0.01", "--progress", "always"]) == 0
        ds = IndexedDataset(prefix)
        results[workers] = [ds[i].tolist() for i in range(len(ds))]
        m = manifest(prefix)
        non_empty = [d for d in DOCS if sp.encode(d)]
        assert m["documents"] == {"read": len(DOCS), "written": len(non_empty), "empty": len(DOCS) - len(non_empty),
                                  "rejected": 0, "blank_lines": 0}
        assert m["tokenizer"]["eod_id"] == m["eod_id"] == sp.eos_id() and m["dtype"] == "uint16"
        assert m["inputs"][0]["sha256"] and m["tokens"] == ds.num_tokens and m["rejects_file"] is None
    assert results["0"] == results["2"] == expected(sp, DOCS, sp.eos_id())  # order and content kept
    err = capsys.readouterr().err
    assert "read 311 documents = written" in err and "tokens/s" in err


def test_megatron_core_reads_prep_output(tmp_path, sp_model):
    mc = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    data = write_jsonl(tmp_path / "in.jsonl", DOCS)
    assert prep(["text", "--input", str(data), "--output-prefix", str(tmp_path / "o"), "--tokenizer",
                 str(sp_model), "--append-eod", "--workers", "0"]) == 0
    theirs = mc.IndexedDataset(str(tmp_path / "o"))
    assert [theirs[i].tolist() for i in range(len(theirs))] == expected(sp, DOCS, sp.eos_id())


def test_huggingface_gz_zst_keep_empty(tmp_path, hf_dir):
    import zstandard
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    eos = ref.token_to_id("</s>")
    write_jsonl(tmp_path / "a.jsonl.gz", DOCS[:100], opener=gzip.open)
    raw = (tmp_path / "b.tmp")
    write_jsonl(raw, DOCS[100:])
    lines = raw.read_bytes().splitlines(keepends=True)
    zc = zstandard.ZstdCompressor()  # two frames back to back, as parallel compressors write them
    (tmp_path / "b.jsonl.zst").write_bytes(zc.compress(b"".join(lines[:50])) + zc.compress(b"".join(lines[50:])))
    raw.unlink()
    prefix = tmp_path / "hf"
    assert prep(["text", "--input", str(tmp_path), "--output-prefix", str(prefix), "--tokenizer", str(hf_dir),
                 "--append-eod", "--keep-empty", "--workers", "2"]) == 0
    ds = IndexedDataset(prefix)
    want = [ref.encode(d, add_special_tokens=False).ids + [eos] for d in DOCS]
    assert [ds[i].tolist() for i in range(len(ds))] == want
    m = manifest(prefix)
    assert [Path(i["path"]).name for i in m["inputs"]] == ["a.jsonl.gz", "b.jsonl.zst"]
    assert m["documents"]["written"] == len(DOCS) and m["documents"]["empty"] == 0
    assert m["tokenizer"]["type"] == "huggingface" and m["tokenizer"]["max_id"] == ref.token_to_id("<|extra|>")


def test_gpt2_vocab_merges_files(tmp_path, capsys):
    """Megatron-LM's GPT2BPETokenizer input (vocab.json + merges.txt), as a folder or vocab + --merge-file."""
    vocab = build_gpt2_files(tmp_path / "tok", "gpt2-vocab.json", "gpt2-merges.txt")
    merges = vocab.with_name("gpt2-merges.txt")
    docs = DOCS[:40] + ["<|endoftext|> inside a document stays text"]
    data = write_jsonl(tmp_path / "in.jsonl", docs)
    eod = json.loads(vocab.read_text())["<|endoftext|>"]
    want = [gpt2_reference_encode(vocab, merges, d) + [eod] for d in docs if d]
    for workers, how in (("0", ["--tokenizer", str(vocab), "--merge-file", str(merges)]),
                         ("2", ["--tokenizer-type", "gpt2-bpe", "--tokenizer", str(vocab)])):
        prefix = tmp_path / f"g{workers}"
        assert prep(["text", "--input", str(data), "--output-prefix", str(prefix), *how, "--append-eod",
                     "--workers", workers, "--block-mb", "0.002"]) == 0
        ds = IndexedDataset(prefix)
        assert ds.dtype == np.uint16 and [ds[i].tolist() for i in range(len(ds))] == want
        m = manifest(prefix)
        assert m["tokenizer"]["type"] == "gpt2-bpe" and m["tokenizer"]["merges_path"] == str(merges)
        assert m["eod_id"] == eod
    capsys.readouterr()
    assert prep(["inspect", str(tmp_path / "g2"), "--doc", "1", "--json"]) == 0  # tokenizer from the manifest
    assert json.loads(capsys.readouterr().out)[0]["decoded"][0]["text"] == docs[1] + "<|endoftext|>"


def test_bom_crlf_and_glob_inputs(tmp_path, sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    (tmp_path / "a.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "first"}\r\n{"text": "second"}\r\n')
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "third"}')  # no final newline
    assert prep(["text", "--input", str(tmp_path / "*.jsonl"), "--output-prefix", str(tmp_path / "out" / "o"),
                 "--tokenizer", str(sp_model), "--workers", "0"]) == 0
    ds = IndexedDataset(tmp_path / "out" / "o")
    assert [ds[i].tolist() for i in range(len(ds))] == [sp.encode(t) for t in ("first", "second", "third")]


def test_wide_vocab_uses_int32(tmp_path):
    tok = build_hf_wide(tmp_path / "wide")
    data = write_jsonl(tmp_path / "in.jsonl", ["w69999 w2", "w65535 w65536 w3"])
    assert prep(["text", "--input", str(data), "--output-prefix", str(tmp_path / "o"), "--tokenizer", str(tok),
                 "--append-eod", "--workers", "0"]) == 0
    ds = IndexedDataset(tmp_path / "o")
    assert ds.dtype == np.int32 and [ds[0].tolist(), ds[1].tolist()] == [[69999, 2, 1], [65535, 65536, 3, 1]]


def test_multi_key_merge_inspect_verify(tmp_path, sp_model, capsys):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    data = write_jsonl(tmp_path / "in.jsonl", DOCS[:50], title="Title ")
    prefix = tmp_path / "mk"
    assert prep(["text", "--input", str(data), "--output-prefix", str(prefix), "--tokenizer", str(sp_model),
                 "--json-keys", "text", "title", "--workers", "0", "--keep-empty"]) == 0
    text, title = IndexedDataset(f"{prefix}_text"), IndexedDataset(f"{prefix}_title")
    assert [text[i].tolist() for i in range(50)] == [sp.encode(d) for d in DOCS[:50]]
    assert [title[i].tolist() for i in range(50)] == [sp.encode(f"Title {i}") for i in range(50)]
    assert not Path(f"{prefix}.bin").exists()
    capsys.readouterr()
    assert prep(["verify", str(prefix)]) == 0
    assert prep(["verify", f"{prefix}_title"]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 3 and "checksums match" in out

    # merge two single-key datasets, then inspect and verify the result
    for name, docs in (("p1", DOCS[:20]), ("p2", DOCS[20:60])):
        write_jsonl(tmp_path / f"{name}.jsonl", docs)
        assert prep(["text", "--input", str(tmp_path / f"{name}.jsonl"), "--output-prefix", str(tmp_path / name),
                     "--tokenizer", str(sp_model), "--append-eod", "--workers", "0"]) == 0
    merged = tmp_path / "merged"
    assert prep(["merge", str(merged), str(tmp_path / "p1"), str(tmp_path / "p2")]) == 0
    ds = IndexedDataset(merged)
    assert [ds[i].tolist() for i in range(len(ds))] == expected(sp, DOCS[:60], sp.eos_id())
    capsys.readouterr()
    assert prep(["verify", str(merged)]) == 0
    capsys.readouterr()
    assert prep(["inspect", str(merged), "--doc", "1", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)[0]
    assert info["documents"] == len(ds) and info["decoded"][0]["text"] == DOCS[1]
    assert sum(c for _, _, c in info["histogram"]) == len(ds)


def test_verify_catches_damage(tmp_path, sp_model, capsys):
    data = write_jsonl(tmp_path / "in.jsonl", DOCS[:30])
    prefix = tmp_path / "o"
    assert prep(["text", "--input", str(data), "--output-prefix", str(prefix), "--tokenizer", str(sp_model),
                 "--workers", "0"]) == 0
    binf = Path(f"{prefix}.bin")
    raw = bytearray(binf.read_bytes())
    raw[0] ^= 1  # same size, different content: only the checksum can tell
    binf.write_bytes(bytes(raw))
    capsys.readouterr()
    assert prep(["verify", str(prefix), "--no-checksums"]) == 0
    assert prep(["verify", str(prefix)]) == 1
    assert "SHA-256 differs" in capsys.readouterr().out
    binf.write_bytes(bytes(raw[:-2]))
    assert prep(["verify", str(prefix)]) == 1
    assert "truncated data file" in capsys.readouterr().out
    Path(f"{prefix}.manifest.json").unlink()
    binf.write_bytes(bytes(raw))
    assert prep(["verify", str(prefix), "--no-checksums"]) == 1
    assert "did not finish" in capsys.readouterr().out


def test_readme_demo_commands(tmp_path):
    """The exact commands mmtrain/demo.py runs, as subprocesses."""
    from dataprep.samples import write_sample_jsonl

    corpus = write_sample_jsonl(tmp_path / "corpus.jsonl", num_docs=300)
    env_py = [sys.executable, "-m", "dataprep"]
    kw = dict(cwd=REPO, check=True, capture_output=True, text=True)
    subprocess.run(env_py + ["train-tokenizer", "--input", str(corpus), "--output-prefix", str(tmp_path / "tok" / "sp"),
                             "--vocab-size", "512"], **kw)
    assert (tmp_path / "tok" / "sp.model").is_file()
    prefix = tmp_path / "data" / "corpus"
    subprocess.run(env_py + ["text", "--input", str(corpus), "--output-prefix", str(prefix), "--tokenizer",
                             str(tmp_path / "tok" / "sp.model"), "--append-eod", "--workers", "2"], **kw)
    res = subprocess.run(env_py + ["verify", str(prefix)], **kw)
    assert res.stdout.startswith("OK ") and "300 documents" in res.stdout


def test_round_trip_property(tmp_path_factory, sp_model):
    """Any Unicode text (control characters, NUL, line/paragraph separators, emoji) comes back exactly."""
    import sentencepiece as spm
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    sp = spm.SentencePieceProcessor(model_file=str(sp_model))

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.text(max_size=200), min_size=1, max_size=12))
    def check(docs):
        folder = tmp_path_factory.mktemp("prop")
        data = write_jsonl(folder / "in.jsonl", docs)
        rc = prep(["text", "--input", str(data), "--output-prefix", str(folder / "o"), "--tokenizer",
                   str(sp_model), "--append-eod", "--workers", "0"])
        if not expected(sp, docs, sp.eos_id()):  # every document empty: a failed run, nothing written
            assert rc == 2 and sorted(p.name for p in folder.iterdir()) == ["in.jsonl"]
            return
        assert rc == 0
        ds = IndexedDataset(folder / "o")
        assert [ds[i].tolist() for i in range(len(ds))] == expected(sp, docs, sp.eos_id())
        counts = manifest(folder / "o")["documents"]
        assert counts["read"] == len(docs) == counts["written"] + counts["empty"]

    check()
