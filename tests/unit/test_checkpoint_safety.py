"""Hostile and broken checkpoints: metadata pickles that would run code are refused before anything runs; every
file is checksummed when written and checked when read; missing or damaged files, and HF folders that do not
fit together, are one-line errors naming the file."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import struct
import subprocess
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata

from mmtrain.config.schema import ModelConfig
from mmtrain.utils.dcp_io import Chunk, load_chunks, save_chunks
from mmtrain.utils.dcp_storage import CheckpointFormatError, DamagedFileError, read_metadata

pytestmark = pytest.mark.unit


# ------------------------------------------------------------------------------------------ hostile pickles
class _Call:
    """Pickles as a call of ``fn(*args)`` (what a hostile ``__reduce__`` does)."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _short(text: str) -> bytes:  # SHORT_BINUNICODE
    data = text.encode()
    return b"\x8c" + bytes([len(data)]) + data


def _stack_global_call(module: str, name: str, arg: str) -> bytes:
    """Protocol 4 by hand: STACK_GLOBAL module name, then REDUCE with (arg,) — pickle resolves a dotted name
    attribute by attribute, so an allowed *module* reaches anything it imported."""
    return b"\x80\x04" + _short(module) + _short(name) + b"\x93" + _short(arg) + b"\x85R."


def _hostile_pickles(marker: Path) -> dict[str, bytes]:
    touch = f"touch {marker}"
    return {
        "reduce to os.system": pickle.dumps(_Call(os.system, touch)),
        "reduce to builtins.eval": pickle.dumps(_Call(eval, f"open({str(marker)!r}, 'w').close()")),
        "reduce to subprocess.call": pickle.dumps(_Call(subprocess.call, ["touch", str(marker)])),
        "dotted name through an allowed module": _stack_global_call(
            "torch.distributed.checkpoint.filesystem", "os.system", touch),
        "dotted name through an allowed class": _stack_global_call(
            "torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__.get", "x"),
        "protocol 0 GLOBAL": f"cos\nsystem\n(S'{touch}'\ntR.".encode(),
        "nested in real metadata": pickle.dumps(Metadata(state_dict_metadata={"x": _Call(os.system, touch)})),
    }


@pytest.mark.parametrize("case", list(_hostile_pickles(Path("m"))))
def test_hostile_metadata_is_refused_and_runs_nothing(case, tmp_path):
    marker = tmp_path / "code-ran"
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    (folder / ".metadata").write_bytes(_hostile_pickles(marker)[case])
    with pytest.raises(CheckpointFormatError) as err:
        read_metadata(folder)
    message = str(err.value)
    assert str(folder / ".metadata") in message and "\n" not in message
    assert "refusing to load" in message
    assert not marker.exists()


def test_real_metadata_still_loads(tmp_path):
    save_chunks(tmp_path, [Chunk("w", (4, 2), (0, 0), torch.arange(8.0).reshape(4, 2)),
                           Chunk("b", (3,), (0,), torch.ones(3, dtype=torch.bfloat16))], no_dist=True)
    assert isinstance(read_metadata(tmp_path), Metadata)


# ---------------------------------------------------------------------------------------------- checksums
def _saved(folder: Path) -> torch.Tensor:
    values = torch.arange(4096.0).reshape(64, 64)
    save_chunks(folder, [Chunk("w", (64, 64), (0, 0), values[:32]), Chunk("w", (64, 64), (32, 0), values[32:])],
                no_dist=True, extra_checksums={"rank_00000.json": {"xxh3_64": "0x0000000000000000", "bytes": 0}})
    return values


def _load(folder: Path, verify: bool = True) -> torch.Tensor:
    out = torch.zeros(64, 64)
    load_chunks(folder, [Chunk("w", (64, 64), (0, 0), out)], verify=verify)
    return out


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _data_file(folder: Path) -> Path:
    [path] = folder.glob("*.distcp")
    return path


def test_every_file_is_recorded_when_written(tmp_path):
    import xxhash

    _saved(tmp_path)
    record = json.loads((tmp_path / "checksums.json").read_text())
    assert record["algorithm"] == "xxh3_64"
    names = {p.name for p in tmp_path.iterdir() if p.name != "checksums.json"}
    assert names <= set(record["files"]) and "rank_00000.json" in record["files"]  # + the caller's own files
    for name in names:
        data = (tmp_path / name).read_bytes()
        assert record["files"][name] == {"xxh3_64": f"0x{xxhash.xxh3_64_intdigest(data):016x}", "bytes": len(data)}


def test_background_hashing_covers_small_and_large_writes_in_order(tmp_path):
    """Small writes are hashed in blocks, large ones in place: the record is still that of the bytes in order."""
    import io

    from mmtrain.utils.file_checksums import _BORROW_MIN, HashingFile, entry_of_bytes

    rng = torch.Generator().manual_seed(0)
    sizes = [3, 100, _BORROW_MIN + 5, 7, *([_BORROW_MIN // 3] * 4), 1, _BORROW_MIN, 2, 9]
    parts = [bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=rng).tolist()) for n in sizes]
    raw = io.BytesIO()
    hashing = HashingFile(raw, background=True)
    for part in parts:
        assert hashing.write(part) == len(part)
    assert hashing.entry() == entry_of_bytes(b"".join(parts)) == entry_of_bytes(raw.getvalue())


def test_a_flipped_byte_is_found_by_default_and_loads_only_unchecked(tmp_path):
    values = _saved(tmp_path)
    assert torch.equal(_load(tmp_path), values)
    path = _data_file(tmp_path)
    _flip_byte(path, path.read_bytes().find(struct.pack("<f", 1000.0)))  # a value: DCP alone would load it
    with pytest.raises(DamagedFileError) as err:
        _load(tmp_path)
    assert str(err.value) == f"{path} does not match its checksum (corrupt?)"
    changed = _load(tmp_path, verify=False) != values  # checkpoint.verify=false: what a load would give
    assert changed.sum() == 1 and values[changed].item() == 1000.0
    _flip_byte(path, path.stat().st_size - 30)  # zip structure: unchecked, torch.load fails; still one line
    with pytest.raises(CheckpointFormatError) as err:
        _load(tmp_path, verify=False)
    assert str(err.value).startswith(f"{path}: could not be read (") and "\n" not in str(err.value)


def test_damaged_metadata_is_found_before_unpickling(tmp_path):
    _saved(tmp_path)
    _flip_byte(tmp_path / ".metadata", 40)
    with pytest.raises(DamagedFileError, match=r"\.metadata does not match its checksum"):
        _load(tmp_path)


@pytest.mark.parametrize("name", [".metadata", "distcp"])
def test_a_missing_file_is_named(name, tmp_path):
    _saved(tmp_path)
    path = _data_file(tmp_path) if name == "distcp" else tmp_path / name
    path.unlink()
    with pytest.raises(DamagedFileError, match=f"{path} is missing"):
        _load(tmp_path)
    (tmp_path / "checksums.json").unlink()  # also without a record (a checkpoint from before checksums)
    with pytest.raises(DamagedFileError, match=f"{path} is missing"):
        _load(tmp_path)


def test_checkpoint_without_checksums_loads_unchecked(tmp_path):
    values = _saved(tmp_path)
    (tmp_path / "checksums.json").unlink()
    assert torch.equal(_load(tmp_path), values)


def test_truncated_file_and_broken_record_are_named(tmp_path):
    _saved(tmp_path)
    path = _data_file(tmp_path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(DamagedFileError, match="bytes, .* when it was written"):
        _load(tmp_path)
    (tmp_path / "checksums.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match="checksums.json: not a readable checksum record"):
        _load(tmp_path)


def test_damaged_file_names_the_previous_complete_checkpoint(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / f"step_{step:08d}").mkdir()
    (tmp_path / "step_00000001" / "complete.json").write_text("{}")
    damaged = DamagedFileError(tmp_path / "step_00000003", "__0_0.distcp", "does not match its checksum (corrupt?)")
    earlier = tmp_path / "step_00000001"  # step 2 never completed
    assert damaged.with_earlier_checkpoint() == (
        f"{tmp_path}/step_00000003/__0_0.distcp does not match its checksum (corrupt?); the previous complete "
        f"checkpoint is {earlier} (checkpoint.load={earlier})")
    first = DamagedFileError(earlier, "x", "is missing")
    assert first.with_earlier_checkpoint("--ckpt").endswith("; there is no earlier complete checkpoint")


def test_metadata_naming_a_file_outside_the_folder_is_refused(tmp_path):
    _saved(tmp_path)
    metadata = read_metadata(tmp_path)
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointFormatError, match="'../outside.distcp' is not a plain file name"):
        _load(tmp_path, verify=False)


# --------------------------------------------------------------------------------------- HF bridge reads
st = pytest.importorskip("safetensors")

from mmtrain.convert.__main__ import main as convert_main  # noqa: E402
from mmtrain.convert.checkpoint_io import write_weights_checkpoint  # noqa: E402
from mmtrain.convert.hf_files import HFFolderError, read_hf_config, read_hf_tensors, write_hf_folder  # noqa: E402


def _hf_folder(folder: Path, shard_bytes: int = 1 << 30) -> dict[str, torch.Tensor]:
    tensors = {"a.weight": torch.randn(16, 16), "b.weight": torch.randn(16, 16)}
    write_hf_folder(folder, {"model_type": "llama"}, tensors, max_shard_bytes=shard_bytes)
    return tensors


def test_hf_export_records_checksums_and_import_checks_them(tmp_path):
    tensors = _hf_folder(tmp_path)
    assert set(json.loads((tmp_path / "mmtrain-checksums.json").read_text())["files"]) == {
        "config.json", "model.safetensors"}
    assert all(torch.equal(read_hf_tensors(tmp_path)[k], v) for k, v in tensors.items())
    path = tmp_path / "model.safetensors"
    _flip_byte(path, path.stat().st_size - 7)
    with pytest.raises(HFFolderError, match=f"{path} does not match its checksum"):
        read_hf_tensors(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(HFFolderError, match="config.json .*delete mmtrain-checksums.json if the file was changed"):
        read_hf_config(tmp_path)


@pytest.mark.parametrize("damage,message", [
    (lambda d: d[:-5], "not a valid safetensors file"),  # truncated data
    (lambda d: d + b"\0" * 8, "not a valid safetensors file"),  # padded: the header no longer fits
    (lambda d: (10**9).to_bytes(8, "little") + d[8:], "header length does not fit the file"),
    (lambda d: d[:8] + b"x" + d[9:], "not a valid safetensors file"),  # the JSON header broken
])
def test_safetensors_that_do_not_fit_their_header_are_named(damage, message, tmp_path):
    _hf_folder(tmp_path)
    (tmp_path / "mmtrain-checksums.json").unlink()  # a folder from elsewhere: no record, the header is the check
    path = tmp_path / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(HFFolderError) as err:
        read_hf_tensors(tmp_path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value) and "\n" not in str(err.value)


def test_hf_index_may_name_files_in_the_folder_only(tmp_path):
    _hf_folder(tmp_path, shard_bytes=1024)
    index = tmp_path / "model.safetensors.index.json"
    assert index.is_file() and read_hf_tensors(tmp_path)
    (tmp_path / "mmtrain-checksums.json").unlink()
    mapping = json.loads(index.read_text())
    mapping["weight_map"]["a.weight"] = "../elsewhere.safetensors"
    index.write_text(json.dumps(mapping))
    with pytest.raises(HFFolderError, match="weight_map names '../elsewhere.safetensors', not a .safetensors file"):
        read_hf_tensors(tmp_path)


def _tiny_weights_checkpoint(root: Path) -> Path:
    from mmtrain.models.llama.model import GPTModel

    cfg = _tiny_cfg()
    torch.manual_seed(0)
    return write_weights_checkpoint(root, GPTModel(cfg).state_dict(), cfg, step=1)


def test_mmtrain_to_hf_verifies_the_checkpoint_like_a_resume(tmp_path, capsys):
    folder = _tiny_weights_checkpoint(tmp_path / "ckpt")
    assert (folder / "checksums.json").is_file()
    path = _data_file(folder)
    _flip_byte(path, path.stat().st_size - 100)
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path} does not match its checksum (corrupt?)" in err
    assert "there is no earlier complete checkpoint" in err and not (tmp_path / "hf").exists()


# ------------------------------------------- complete.json says whether checksums are required (issue #29 item 7)
def _tiny_cfg() -> ModelConfig:
    return ModelConfig(num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=2, ffn_hidden_size=32,
                       vocab_size=32, activation="swiglu", norm="rmsnorm")


def _load_weights(folder: Path) -> None:
    """What generate, serve, evaluate and a run from weights-only checkpoints do: ``load_model_weights``."""
    from types import SimpleNamespace

    from mmtrain.convert.checkpoint_io import load_model_weights
    from mmtrain.models.llama.model import GPTModel

    mesh = SimpleNamespace(dims=SimpleNamespace(tp=1, ep=1), coord=SimpleNamespace(tp=0, ep=0))
    load_model_weights(folder, mesh, GPTModel(_tiny_cfg()))


class _Warnings(logging.Handler):
    """The checkpoint logger's warnings (whatever handlers an earlier test left on the mmtrain logger)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("mmtrain.checkpoint").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("mmtrain.checkpoint").removeHandler(self)


def test_a_deleted_checksums_json_does_not_turn_verification_off(tmp_path, capsys):
    from mmtrain.convert.checkpoint_io import ConvertError
    from mmtrain.models.llama.model import GPTModel
    from mmtrain.train.checkpoint_state import load_model_weights_only

    folder = _tiny_weights_checkpoint(tmp_path / "ckpt")
    assert json.loads((folder / "complete.json").read_text())["checkpoint_format"] == 2
    path = _data_file(folder)
    _flip_byte(path, path.stat().st_size - 100)
    (folder / "checksums.json").unlink()
    missing = (f"{folder}/checksums.json is missing, and complete.json says the checkpoint was written with "
               "checksums: its files cannot be checked; there is no earlier complete checkpoint")
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == f"python -m mmtrain.convert mmtrain-to-hf: error: {missing}\n"
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ConvertError) as err:  # generate / serve / evaluate / weights-only starts
        _load_weights(folder)
    assert str(err.value) == missing
    with pytest.raises(DamagedFileError, match="checksums.json is missing, and complete.json says"):
        load_model_weights_only(folder, None, GPTModel(_tiny_cfg()))  # a VLM run's init_from, the demo
    # re-hashing cannot bless the damage: without a record its files are not trusted unless the user says so
    assert convert_main(["rehash", "--ckpt", str(folder)]) == 2
    assert "--trust-current-files" in capsys.readouterr().err
    assert convert_main(["rehash", "--ckpt", str(folder), "--trust-current-files"]) == 0
    _load_weights(folder)


def test_an_edited_complete_json_is_refused_until_sealed_again(tmp_path, capsys):
    from mmtrain.train.checkpoint import CheckpointError, is_weights_only

    folder = _tiny_weights_checkpoint(tmp_path / "ckpt")
    meta = json.loads((folder / "complete.json").read_text())
    meta["config"]["model"]["vocab_size"] = 10**12  # as unnoticed as it was before the seal
    (folder / "complete.json").write_text(json.dumps(meta, indent=1))
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (
        f"{folder}/complete.json does not match its seal (changed after it was written?); if you edited it on "
        f"purpose, seal it again: python -m mmtrain.convert rehash --ckpt {folder}") in err
    with pytest.raises(CheckpointError, match="complete.json does not match its seal"):  # what a run reads first
        is_weights_only(folder)
    meta["config"]["model"]["name"] = "renamed"  # an edit on purpose, sealed again
    meta["config"]["model"]["vocab_size"] = 32
    (folder / "complete.json").write_text(json.dumps(meta, indent=1))
    assert convert_main(["rehash", "--ckpt", str(tmp_path / "ckpt")]) == 0
    assert "2 file(s) matched checksums.json, 0 hashed" in capsys.readouterr().out
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    path = _data_file(folder)
    _flip_byte(path, path.stat().st_size - 100)  # re-sealing checks the recorded files first
    assert convert_main(["rehash", "--ckpt", str(folder)]) == 2
    assert capsys.readouterr().err.endswith(f"{path} does not match its checksum (corrupt?); re-sealing does not "
                                            "record a damaged file as good\n")
    (folder / "checksums.json").write_text((folder / "checksums.json").read_text() + " ")  # changed: noticed
    with pytest.raises(DamagedFileError, match="checksums.json is .* bytes, .* when it was written .*complete.json"):
        read_metadata(folder)


def test_a_checkpoint_from_before_checksums_loads_with_a_warning_naming_rehash(tmp_path, capsys):
    folder = _tiny_weights_checkpoint(tmp_path / "ckpt")
    meta = json.loads((folder / "complete.json").read_text())
    for key in ("checkpoint_format", "checksums_record", "seal"):  # what earlier versions wrote
        meta.pop(key)
    (folder / "complete.json").write_text(json.dumps(meta, indent=1))
    (folder / "checksums.json").unlink()
    with _Warnings() as warned:
        assert convert_main(["mmtrain-to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    assert warned.lines == [f"{folder} has no checksums.json and its complete.json predates checkpoint checksums: "
                            "reading its files unchecked; to record their hashes as they are now (and check them "
                            f"from then on): python -m mmtrain.convert rehash --ckpt {folder}"]
    assert convert_main(["rehash", "--ckpt", str(tmp_path / "ckpt")]) == 0
    assert "0 file(s) matched checksums.json, 2 hashed as they are now (.metadata, __0_0.distcp)" in \
        capsys.readouterr().out
    assert json.loads((folder / "complete.json").read_text())["checkpoint_format"] == 2
    with _Warnings() as warned:
        _load_weights(folder)
    assert warned.lines == []
    path = _data_file(folder)
    _flip_byte(path, path.stat().st_size - 100)
    with pytest.raises(Exception, match="does not match its checksum"):
        _load_weights(folder)
    (folder / "checksums.json").unlink()
    with pytest.raises(Exception, match="checksums.json is missing, and complete.json says"):
        _load_weights(folder)


# ----------------------------------------------- sizes in .metadata checked before allocating (issue #29 item 8)
def _claim(folder: Path, edit) -> None:
    """Rewrite ``.metadata`` through ``edit(metadata)`` and every record after it (checksums.json, complete.json),
    as someone who also rewrites the checksums would."""
    from mmtrain.utils.checkpoint_marker import reseal_checkpoint

    metadata = read_metadata(folder)
    edit(metadata)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal_checkpoint(folder, trust_current_files=True)


def _embed(metadata):
    return metadata.state_dict_metadata["model.embed.weight"]


def _huge_size(metadata) -> None:
    _embed(metadata).size = torch.Size([10**13, 16])


def _huge_chunk(metadata) -> None:
    _huge_size(metadata)
    _embed(metadata).chunks[0].sizes = torch.Size([10**13, 16])


def _chunk_outside(metadata) -> None:
    _embed(metadata).chunks[0].offsets = torch.Size([8, 0])


def _range_past_the_end(metadata) -> None:
    for info in metadata.storage_data.values():
        info.length += 10**12


@pytest.mark.parametrize("edit,message", [
    (_huge_size, "claims tensor 'model.embed.weight' of size (10000000000000, 16) (160000000000000 elements), but "
                 "its stored chunks hold 512"),
    (_huge_chunk, "claims a chunk of tensor 'model.embed.weight' of sizes (10000000000000, 16) (640000000000000 "
                  "bytes), but stores 3625 bytes for it in __0_0.distcp"),
    (_chunk_outside, "places a chunk of tensor 'model.embed.weight' (offsets torch.Size([8, 0]), sizes "
                     "torch.Size([32, 16])) outside its size (32, 16)"),
    (_range_past_the_end, "__0_0.distcp is "),
], ids=["size", "chunk", "outside", "range"])
def test_metadata_sizes_are_checked_against_the_files_before_allocating(edit, message, tmp_path, capsys):
    from mmtrain.utils.dcp_io import saved_tensors

    folder = _tiny_weights_checkpoint(tmp_path / "ckpt")
    _claim(folder, edit)
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(folder), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "hf").exists()
    with pytest.raises(DamagedFileError, match=re.escape(message)):  # resume, generate, init_from: the same reader
        saved_tensors(folder, verify=False)


def test_a_truncated_data_file_is_named_by_its_record_or_the_metadata(tmp_path):
    folder = _tiny_weights_checkpoint(tmp_path / "ckpt")
    path = _data_file(folder)
    path.write_bytes(path.read_bytes()[:-10])
    size = path.stat().st_size
    with pytest.raises(DamagedFileError, match=re.escape(f"{path} is {size} bytes, ") + ".* when it was written"):
        read_metadata(folder)
    with pytest.raises(DamagedFileError, match=re.escape(f"{path} is {size} bytes, but .metadata places")):
        read_metadata(folder, verify=False)


def test_hf_to_mmtrain_names_a_damaged_export(tmp_path, capsys):
    _hf_folder(tmp_path / "hf")
    _flip_byte(tmp_path / "hf" / "model.safetensors", 100)
    assert convert_main(["hf-to-mmtrain", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.safetensors does not match its checksum" in err


# ------------------------------------------------------------------------------- run_distributed results
def test_rank_results_are_loaded_weights_only():
    import io

    import numpy as np

    from mmtrain.testing import load_result

    buffer = io.BytesIO()
    torch.save({"t": torch.ones(2), "a": [np.arange(3)], "s": np.float32(1.5), "x": (1, "y", None)}, buffer)
    value = load_result(buffer.getvalue())
    assert torch.equal(value["t"], torch.ones(2)) and value["a"][0].tolist() == [0, 1, 2] and value["x"][1] == "y"
    buffer = io.BytesIO()
    torch.save(_Call(os.system, "true"), buffer)
    with pytest.raises(TypeError, match="must return tensors"):
        load_result(buffer.getvalue())
