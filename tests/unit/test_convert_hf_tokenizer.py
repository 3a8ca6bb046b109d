"""mmtrain-to-hf writes the tokenizer files and generation_config.json: the export loads in a transformers
text-generation pipeline with no extra step, and its tokenizer gives the ids mmtrain's tokenizer gives."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from dataprep.cli import main as prep_main  # noqa: E402
from mmtrain.convert.__main__ import main as convert_main  # noqa: E402
from mmtrain.convert.hf_tokenizer import hf_tokenizer_files  # noqa: E402
from mmtrain.core.tokenizer import load_tokenizer  # noqa: E402
from mmtrain.utils.checkpoint_marker import reseal_checkpoint  # noqa: E402
from tests.eval_helpers import train_sentencepiece, write_checkpoint_for  # noqa: E402
from tests.unit.test_tokenizer import TRICKY_DOCS, build_gpt2_files, build_hf_bpe  # noqa: E402

pytestmark = pytest.mark.unit

TEXTS = [*TRICKY_DOCS[:3], TRICKY_DOCS[5], "Hello world", "new\nline\n\n  indented", "two  spaces"]


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("spm"))


def _export_and_check(tmp_path, tokenizer: Path, extra_args=()) -> Path:
    ours = load_tokenizer(tokenizer)
    ckpt, model = write_checkpoint_for(tmp_path / "ckpt", ours.vocab_size + 8)
    out = tmp_path / "hf"
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(out), *extra_args,
                         *(["--tokenizer", str(tokenizer)] if tokenizer is not None and not extra_args else [])]) == 0
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    sums = json.loads((out / "mmtrain-checksums.json").read_text())
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(sums["files"])
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ours.eod_id
    pipe = transformers.pipeline("text-generation", model=str(out))  # nothing but the folder
    for text in TEXTS:
        assert pipe.tokenizer.encode(text, add_special_tokens=False) == ours.encode(text), text
    prompt = "The quick brown"
    got = pipe(prompt, max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
    ids = torch.tensor([pipe.tokenizer.encode(prompt)])
    with torch.no_grad():  # greedy by hand on the mmtrain model: the pipeline's text is its decode
        for _ in range(8):
            nxt = model(ids)[0, -1].argmax()
            if nxt.item() == ours.eod_id:
                break
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    assert got == pipe.tokenizer.decode(ids[0, len(pipe.tokenizer.encode(prompt)):])
    return out


def test_a_huggingface_tokenizer_json_is_exported(tmp_path):
    folder = build_hf_bpe(tmp_path / "tok")
    _export_and_check(tmp_path, folder)


def test_a_sentencepiece_model_is_exported_as_a_fast_tokenizer(tmp_path, spm_model):
    out = _export_and_check(tmp_path, spm_model)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    # special-token strings inside text stay text, as mmtrain-prep encoded them
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.encode("a <s> b", add_special_tokens=False) == load_tokenizer(spm_model).encode("a <s> b")


def test_the_tokenizer_recorded_in_the_checkpoints_data_manifest_is_used(tmp_path, spm_model):
    ours = load_tokenizer(spm_model)
    ckpt, _ = write_checkpoint_for(tmp_path / "ckpt", ours.vocab_size)
    prefix = tmp_path / "data"
    Path(f"{prefix}.manifest.json").write_text(json.dumps({"tokenizer": {**ours.describe(),
                                                                         "sha256": ours.checksum()}}))
    meta_path = ckpt / "step_00000000" / "complete.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["data"]["prefixes"] = [str(prefix)]
    meta_path.write_text(json.dumps(meta))
    reseal_checkpoint(meta_path.parent)  # an edit on purpose: sealed again (rehash), else the export refuses it
    out = tmp_path / "hf"
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.encode("Hello world", add_special_tokens=False) == ours.encode("Hello world")
    # the tokenizer file changed since the data was prepared: a one-line error, nothing guessed
    Path(f"{prefix}.manifest.json").write_text(json.dumps({"tokenizer": {**ours.describe(), "sha256": "0" * 64}}))
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf2")]) == 2
    assert not (tmp_path / "hf2").exists()
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf3"), "--no-tokenizer"]) == 0
    assert not (tmp_path / "hf3" / "tokenizer.json").exists()


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(tmp_path, spm_model, capsys):
    ckpt, _ = write_checkpoint_for(tmp_path / "ckpt", 64)
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(tmp_path / "hf"), "--tokenizer",
                         str(spm_model)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "vocabulary is 64" in err


def test_gpt2_files_are_exported(tmp_path):
    _export_and_check(tmp_path, build_gpt2_files(tmp_path / "gpt2"))


def _collapsing_sentencepiece(folder: Path) -> Path:
    path = train_sentencepiece(folder)  # its corpus again, with SentencePiece's whitespace collapsing
    assert prep_main(["train-tokenizer", "--input", str(folder / "corpus.jsonl"), "--output-prefix",
                      str(folder / "collapse"), "--vocab-size", "400", "--collapse-whitespace"]) == 0
    return path.with_name("collapse.model")


SOURCES = {"sentencepiece": train_sentencepiece, "sentencepiece, collapsed whitespace": _collapsing_sentencepiece,
           "gpt2": build_gpt2_files, "tokenizer.json": build_hf_bpe}


def _mixed_byte_run(sp, ids: list[int]) -> bool:
    """A run of byte-fallback pieces that is not valid UTF-8 yet holds a valid character: the one case where
    tokenizers' ByteFallback (U+FFFD for every byte of the run) and SentencePiece (per character) differ."""
    runs, run = [], []
    for i in [*ids, -1]:
        if i >= 0 and sp.is_byte(i):
            run.append(int(sp.id_to_piece(i)[3:5], 16))
        elif run:
            runs.append(bytes(run))
            run = []
    return any(r.decode("utf-8", "replace") != r.decode("utf-8", "ignore") and r.decode("utf-8", "ignore")
               for r in runs)


@pytest.mark.parametrize("kind", list(SOURCES))
def test_the_export_decodes_random_ids_as_the_source_does(tmp_path, kind):
    import sentencepiece as spm

    ours = load_tokenizer(SOURCES[kind](tmp_path / "tok"))
    files, _ = hf_tokenizer_files(ours)
    (tmp_path / "hf").mkdir()
    for name, data in files.items():
        (tmp_path / "hf" / name).write_bytes(data)
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sp = spm.SentencePieceProcessor(model_file=str(ours.path)) if ours.type == "sentencepiece" else None
    special = set(exported.all_special_ids)
    # weighted to what decodes differently at the start of a text: standalone spaces ('▁', '▁▁', 'Ġ'), the
    # space byte, control and unknown ids
    tricky = [i for i in range(ours.vocab_size) if set(ours.decode([i])) <= {" "}] + sorted(special)
    rng = random.Random(0)
    checked = 0
    for _ in range(3000):
        ids = [rng.choice(tricky) if rng.random() < 0.4 else rng.randrange(ours.vocab_size)
               for _ in range(rng.randrange(1, 10))]
        if sp is not None and _mixed_byte_run(sp, [i for i in ids if i not in special]):
            continue
        checked += 1
        assert exported.decode(ids, skip_special_tokens=True) == ours.decode(ids, skip_special_tokens=True), ids
        if not special & set(ids):  # shown, special tokens appear by name in transformers
            assert exported.decode(ids) == ours.decode(ids), ids
    assert checked > 1500
    space = ours.token_id("▁")
    if space is not None:  # issue #30: eight standalone '▁' pieces, and one before a word
        word = next(i for i in range(ours.vocab_size) if ours.decode([0, i]).endswith(" and"))
        for ids in ([space] * 8, [space, word], [space] * 3 + [word]):
            assert exported.decode(ids) == ours.decode(ids), ids


def test_a_mixed_byte_run_is_the_documented_difference(tmp_path, spm_model):
    ours = load_tokenizer(spm_model)
    files, _ = hf_tokenizer_files(ours)
    (tmp_path / "hf").mkdir()
    for name, data in files.items():
        (tmp_path / "hf" / name).write_bytes(data)
    exported = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = [ours.token_id(f"<0x{b:02X}>") for b in (0xC3, 0xA9, 0x80)]  # "é" then an invalid byte
    assert ours.decode(ids) == "é\ufffd" and exported.decode(ids) == "\ufffd" * 3  # docs/convert-hf.md
