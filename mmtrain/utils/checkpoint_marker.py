"""``complete.json``, the marker that makes a checkpoint count, and what it says about the checkpoint's checksums.

A checkpoint counts once ``complete.json`` is written, after every other file. This version writes it with
``"checkpoint_format": 2``, the record (XXH3 hash and size) of ``checksums.json`` (which records every other
file) and a ``"seal"``: the XXH3 hash of all its other entries as canonical JSON. So a reader notices a deleted or
changed ``checksums.json`` and an edited ``complete.json`` (its model config, say), each as a one-line error
naming the file. A marker without ``checkpoint_format`` says its checkpoint was written before this format: its
files are checked against a ``checksums.json`` when there is one, and read unchecked with a warning when there
is none; ``reseal_checkpoint`` (``python -m mmtrain.convert rehash``) brings such a checkpoint, or one whose
``complete.json`` was edited on purpose, to this format. Like every checksum here, the seal guards against damage
and accidental edits, not against someone who recomputes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmtrain.utils.atomic import atomic_write_text
from mmtrain.utils.file_checksums import (
    ALGORITHM,
    entry_of_bytes,
    entry_of_file,
    file_problem,
    read_record,
    record_text,
)
from mmtrain.utils.log import get_logger

COMPLETE_NAME = "complete.json"
CHECKSUMS_NAME = "checksums.json"
METADATA_NAME = ".metadata"
FORMAT_KEY = "checkpoint_format"
FORMAT_VERSION = 2  # 2: complete.json sealed, checksums.json required and recorded in it
_SEAL_KEY = "seal"
_RECORD_KEY = "checksums_record"  # complete.json's record of checksums.json


class CheckpointFormatError(ValueError):
    """A checkpoint folder that is not what the reader needs; the message names the folder and key."""


class DamagedFileError(CheckpointFormatError):
    """A checkpoint file that is missing or does not match the checksum recorded when it was written."""

    def __init__(self, folder: Path, name: str, problem: str) -> None:
        super().__init__(f"{Path(folder) / name} {problem}")
        self.folder, self.name, self.problem = Path(folder), name, problem

    def with_earlier_checkpoint(self, option: str = "checkpoint.load") -> str:
        """This error, and the checkpoint to use instead (set through ``option``), in one line."""
        earlier = earlier_complete_checkpoint(self.folder)
        instead = (f"the previous complete checkpoint is {earlier} ({option}={earlier})" if earlier is not None
                   else "there is no earlier complete checkpoint")
        return f"{self}; {instead}"


def earlier_complete_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint (``step_*`` with ``complete.json``) of ``folder``'s root older than it."""
    folder = Path(folder)
    older = sorted(p for p in folder.parent.glob("step_*") if p.name < folder.name and (p / COMPLETE_NAME).is_file())
    return older[-1] if older else None


def rehash_command(folder: Path) -> str:
    return f"python -m mmtrain.convert rehash --ckpt {folder}"


# ------------------------------------------------------------------------------------------------ writing
def _seal_of(body: dict[str, Any]) -> str:
    """XXH3 of ``body`` without its seal, as canonical JSON (sorted keys, no spaces) of its JSON round trip, so
    the reader, which has only the parsed file, computes the same text."""
    plain = json.loads(json.dumps({k: v for k, v in body.items() if k != _SEAL_KEY}))
    return entry_of_bytes(json.dumps(plain, sort_keys=True, separators=(",", ":")).encode("utf-8"))[ALGORITHM]


def write_marker(folder: Path, meta: dict[str, Any]) -> None:
    """Write ``folder/complete.json`` (atomically) holding ``meta``, this format's version, the record of
    ``folder/checksums.json`` (written before: it records every other file) and the seal."""
    folder = Path(folder)
    record = folder / CHECKSUMS_NAME
    if not record.is_file():  # a bug, not an input: every save writes it before the marker
        raise CheckpointFormatError(f"{record} is missing: a checkpoint is marked complete only after its "
                                    "checksums are written")
    body = {k: v for k, v in meta.items() if k not in (_SEAL_KEY, _RECORD_KEY, FORMAT_KEY)}
    body.update({FORMAT_KEY: FORMAT_VERSION, _RECORD_KEY: entry_of_file(record)})
    atomic_write_text(folder / COMPLETE_NAME, json.dumps({**body, _SEAL_KEY: _seal_of(body)}, indent=1))


# ------------------------------------------------------------------------------------------------ reading
def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DamagedFileError(path.parent, path.name, "is missing (the checkpoint is incomplete)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(f"{path}: not valid JSON ({exc}); the file is damaged") from None
    if not isinstance(value, dict):
        raise CheckpointFormatError(f"{path}: not a JSON object; the file is damaged")
    return value


def read_marker(folder: Path) -> dict[str, Any]:
    """``folder/complete.json``, its seal checked when it has one (this format); one that has neither seal nor
    format version was written before them and is returned as it is. ``CheckpointFormatError`` (a
    ``DamagedFileError`` for a missing or changed file) naming the file."""
    folder = Path(folder)
    meta = _read_json_object(folder / COMPLETE_NAME)
    if FORMAT_KEY not in meta and _SEAL_KEY not in meta:
        return meta
    if meta.get(_SEAL_KEY) != _seal_of(meta):
        raise DamagedFileError(folder, COMPLETE_NAME, "does not match its seal (changed after it was written?); if "
                                                      "you edited it on purpose, seal it again: "
                                                      f"{rehash_command(folder)}")
    if meta.get(FORMAT_KEY) != FORMAT_VERSION:
        raise CheckpointFormatError(f"{folder / COMPLETE_NAME}: checkpoint_format {meta.get(FORMAT_KEY)!r} is not "
                                    f"one this mmtrain reads ({FORMAT_VERSION}); a newer mmtrain wrote it?")
    return meta


def _is_entry(value: Any) -> bool:
    return isinstance(value, dict) and isinstance(value.get(ALGORITHM), str) and isinstance(value.get("bytes"), int)


def read_checksums(folder: Path) -> dict[str, dict[str, Any]] | None:
    """The checkpoint's checksum records by file name. A checkpoint whose ``complete.json`` has this format must
    have its ``checksums.json``, as recorded there (else ``DamagedFileError``). None only for a checkpoint written
    before checksums (an old marker, no ``checksums.json``) or a folder not marked complete without one (a
    save in progress, a plain DCP folder)."""
    folder = Path(folder)
    if (folder / COMPLETE_NAME).is_file():
        meta = read_marker(folder)
        if FORMAT_KEY in meta:
            entry = meta.get(_RECORD_KEY)
            if not _is_entry(entry):
                raise CheckpointFormatError(f"{folder / COMPLETE_NAME}: no valid record of {CHECKSUMS_NAME}; the "
                                            "file is damaged")
            problem = file_problem(folder / CHECKSUMS_NAME, entry)
            if problem == "is missing":
                raise DamagedFileError(folder, CHECKSUMS_NAME, "is missing, and complete.json says the checkpoint "
                                                               "was written with checksums: its files cannot be "
                                                               "checked")
            if problem:
                raise DamagedFileError(folder, CHECKSUMS_NAME, f"{problem} (the record in complete.json)")
    try:
        return read_record(folder / CHECKSUMS_NAME)
    except ValueError as exc:
        raise CheckpointFormatError(str(exc)) from None


def unchecked_warning(folder: Path) -> str:
    return (f"{folder} has no {CHECKSUMS_NAME} and its complete.json predates checkpoint checksums: reading its "
            f"files unchecked; to record their hashes as they are now (and check them from then on): "
            f"{rehash_command(folder)}")


def checksums_for(folder: Path, verify: bool) -> dict[str, dict[str, Any]] | None:
    """What a reader checks ``folder``'s files against: ``read_checksums`` with ``verify`` (a warning in the log
    when a complete checkpoint from before checksums is read unchecked), None without."""
    if not verify:
        return None
    checksums = read_checksums(folder)
    if checksums is None and (Path(folder) / COMPLETE_NAME).is_file():
        get_logger("checkpoint").warning(unchecked_warning(folder))
    return checksums


# ----------------------------------------------------------------------------------------------- re-sealing
def _data_files(folder: Path) -> list[str]:
    """The files a checkpoint's checksums cover: DCP's metadata and data files and the per-rank JSON."""
    return sorted(p.name for p in folder.iterdir() if p.is_file() and (
        p.name == METADATA_NAME or p.suffix == ".distcp" or (p.name.startswith("rank_") and p.suffix == ".json")))


@dataclass
class ResealReport:
    folder: Path
    checked: list[str]  # files that matched the checksums.json they were recorded in
    hashed: list[str]  # files hashed as they are now (no record, or trust_current_files)


def reseal_checkpoint(folder: Path, trust_current_files: bool = False) -> ResealReport:
    """Bring the complete checkpoint in ``folder`` to this format: the files ``checksums.json`` records are
    checked against it (a damaged one is refused: re-sealing must not bless it), files it lacks are hashed as
    they are, then ``checksums.json`` and the sealed ``complete.json`` (its content as it is now) are written.
    A checkpoint already of this format (its ``complete.json`` edited on purpose) may not gain unrecorded files
    or lose its record; ``trust_current_files`` hashes every file as it is now instead of checking anything."""
    folder = Path(folder)
    meta = _read_json_object(folder / COMPLETE_NAME)
    sealed_format = FORMAT_KEY in meta or _SEAL_KEY in meta
    names = _data_files(folder)
    if trust_current_files:
        record: dict[str, dict[str, Any]] = {}
    else:
        try:
            found = read_record(folder / CHECKSUMS_NAME)
        except ValueError as exc:
            raise CheckpointFormatError(f"{exc}; pass --trust-current-files to hash the files as they are") from None
        record = found or {}
        unrecorded = [n for n in names if n not in record]
        if sealed_format and (found is None or unrecorded):
            what = f"{CHECKSUMS_NAME} is missing" if found is None else f"{unrecorded[0]} is not in {CHECKSUMS_NAME}"
            raise CheckpointFormatError(
                f"{folder}: {what}, but complete.json says the checkpoint was written with checksums: its files "
                "cannot be checked, so they are not re-hashed; pass --trust-current-files if you know they are "
                "intact, or use another checkpoint")
        for name in sorted(record):
            problem = file_problem(folder / name, record[name])
            if problem:
                raise DamagedFileError(folder, name, f"{problem}; re-sealing does not record a damaged file as good")
    hashed = [n for n in names if n not in record]
    files = {**record, **{n: entry_of_file(folder / n) for n in hashed}}
    atomic_write_text(folder / CHECKSUMS_NAME, record_text(files))
    write_marker(folder, meta)
    return ResealReport(folder, sorted(record), hashed)
