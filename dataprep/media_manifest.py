"""Input side of `mmtrain-prep media`: manifest rows (JSONL) or a plain media folder -> `MediaRow`s.

Everything here is cheap and runs in the main process, in input order: JSON parsing, field checks, path
resolution and the duplicate-id check. Problems become `Reject`s (never exceptions), so every input record
is either packed later or reported in `rejects.jsonl`. Decoding the media is `media_codecs`' job.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from dataprep.sft_records import message_weight

IMAGE_EXTS = {"jpg": "JPEG", "jpeg": "JPEG", "png": "PNG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP",
              "tif": "TIFF", "tiff": "TIFF"}
AUDIO_EXTS = {"wav", "flac", "ogg", "oga", "opus", "mp3", "m4a"}
VIDEO_EXTS = {"mp4", "webm", "mkv", "mov", "avi"}
MEDIA_FIELDS = ("image", "images", "video", "audio")
TEXT_FIELDS = ("caption", "text", "conversation")
CHAT_FIELDS = ("messages", "conversations")  # chat SFT rows: images inside the user turns (`media_chat`)
# Where an image sits in a chat message while it is rendered with the chat template (the LLaVA convention; a
# ShareGPT row writes it itself). The tokens of each occurrence become one image slot.
IMAGE_PLACEHOLDER = "<image>"
_CHAT_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "human": "user", "gpt": "assistant"}
# Energon splits a tar member name at the first dot into sample key and part, so keys hold no dots or
# slashes; the 80-character cap keeps every member name inside the plain ustar header (fixed bytes).
_KEY_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_MAX_KEY = 80
# Deepest nesting of lists/objects a row may hold. Deeper rows are rejected in the main process: the
# sample's metadata is pickled to a worker and written as JSON, and both recurse once per level.
MAX_NESTING = 64


@dataclass(frozen=True)
class Reject:
    """One input record that is not packed, with a stable reason code and a message saying what to do."""

    source: str
    line: int
    code: str
    reason: str
    record: str

    def to_json(self) -> dict:
        return {"source": self.source, "line": self.line, "code": self.code, "reason": self.reason,
                "record": self.record}


@dataclass(frozen=True)
class MediaRow:
    """One sample to pack. Paths are absolute (resolved); ``rel`` keeps them as written, for metadata."""

    source: str
    line: int
    record: str
    id: str
    key: str
    images: tuple[str, ...] = ()
    video: str | None = None
    audio: str | None = None
    rel: dict = field(default_factory=dict)
    text_field: str | None = None  # "caption" | "text" | "conversation"
    text: str | None = None
    conversation: tuple = ()
    extra: dict = field(default_factory=dict)
    # chat rows (text_field "chat"): ``conversation`` holds the messages with IMAGE_PLACEHOLDER where each image
    # goes; ``chat`` the prepared tokens (-1 at each image) and loss mask, filled in by `media_chat`
    chat: dict | None = None

    @property
    def modality(self) -> str:
        if self.video:
            return "video"
        if self.audio:
            return "audio"
        if not self.images and self.text_field == "chat":
            return "text"  # a text-only conversation among the chat rows (trained with its loss mask too)
        return "images" if len(self.images) > 1 else "image"


def sample_key(sample_id: str) -> str:
    """Tar-safe, stable key for a sample id (unsafe characters -> '_', long ids shortened with a hash)."""
    key = _KEY_UNSAFE.sub("_", sample_id) or "_"
    if len(key) > _MAX_KEY:
        key = key[: _MAX_KEY - 17] + "_" + hashlib.sha1(sample_id.encode()).hexdigest()[:16]
    return key


def is_val(key: str, val_ratio: float) -> bool:
    """Deterministic train/val assignment from the key alone (independent of order, workers and resume)."""
    if val_ratio <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return h / 2.0**64 < val_ratio


def media_kind(path: str) -> str | None:
    ext = path.rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    if ext in IMAGE_EXTS:
        return "image"
    if ext in AUDIO_EXTS:
        return "audio"
    if ext in VIDEO_EXTS:
        return "video"
    return None


class _RowError(Exception):
    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


def _resolve(base: Path, value, field_name: str, allow_outside: bool) -> tuple[str, str]:
    if not isinstance(value, str) or not value.strip():
        raise _RowError("bad_field", f"field {field_name!r} must be a non-empty path string, got {_short(value)}")
    if "\0" in value:
        raise _RowError("bad_field", f"{field_name} path {_short(value)} holds a NUL character; no file can "
                        "have that name")
    if (os.path.isabs(value) or ".." in Path(value).parts) and not allow_outside:
        raise _RowError("outside_path", f"{field_name} path {_short(value)} is absolute or climbs out with '..'; "
                        "paths are relative to the manifest's folder (pass --allow-outside to permit)")
    try:
        path = os.path.realpath(os.path.join(base, value))
    except (OSError, ValueError) as exc:  # e.g. a name the file system cannot encode
        raise _RowError("bad_field", f"{field_name} path {_short(value)} is not a usable file name "
                        f"({type(exc).__name__})") from None
    if not allow_outside:
        _check_inside(path, str(base), f"{field_name} path {_short(value)}", "the manifest's folder")
    return path, value


def _check_inside(path: str, folder: str, what: str, where: str) -> None:
    """``path`` (resolved) must be ``folder`` (resolved) or lie below it: symlinks may not lead out."""
    root = _real_folder(folder)
    if path != root and not path.startswith(root.rstrip(os.sep) + os.sep):
        raise _RowError("outside_path", f"{what} resolves outside {where} (to {path}); "
                        "pass --allow-outside to permit")


def _short(value, limit: int = 120) -> str:
    """repr() of a user value for a reason, cut to ``limit`` characters (a reason is one readable line)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def check_values(obj) -> None:
    """Reject what no later step can take: nesting deeper than MAX_NESTING, and strings (keys included)
    that are not valid Unicode (a lone surrogate escape such as "\\ud800" cannot be written as UTF-8)."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise _RowError("bad_field", f"a string holds a lone surrogate escape "
                                f"(\\u{ord(value[exc.start]):04x}): not valid Unicode; fix the JSON escape") from None
        elif isinstance(value, (dict, list)):
            if depth > MAX_NESTING:
                raise _RowError("bad_field", f"lists/objects nested deeper than {MAX_NESTING} levels")
            items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
            for k, v in items:
                if k is not None:
                    stack.append((k, depth + 1))
                stack.append((v, depth + 1))


@functools.lru_cache(maxsize=64)
def _real_folder(folder: str) -> str:
    return os.path.realpath(folder)


def parse_record(obj, base: Path, source: str, line: int, record: str, allow_outside: bool) -> MediaRow:
    """Check one manifest object and turn it into a MediaRow; raises _RowError with a reason code."""
    if not isinstance(obj, dict):
        raise _RowError("malformed_line", f"expected a JSON object, got {type(obj).__name__}")
    if any(f in obj for f in CHAT_FIELDS):
        return _chat_record(obj, base, source, line, record, allow_outside)
    present = [f for f in MEDIA_FIELDS if obj.get(f) not in (None, [], "")]
    if not present:
        raise _RowError("no_media", f"no media field; give one of {', '.join(MEDIA_FIELDS)}")
    if len(present) > 1:
        raise _RowError("bad_field", f"one media field per row, got {present}; split the row into several")
    rel: dict = {}
    images: tuple[str, ...] = ()
    video = audio = None
    kind = present[0]
    if kind in ("image", "images"):
        values = obj[kind] if kind == "images" else [obj[kind]]
        if not isinstance(values, list) or not values:
            raise _RowError("bad_field", f"field 'images' must be a non-empty list of paths, got {_short(obj[kind])}")
        resolved = [_resolve(base, v, kind, allow_outside) for v in values]
        images = tuple(r[0] for r in resolved)
        rel["images"] = [r[1] for r in resolved]
    elif kind == "video":
        video, rel["video"] = _resolve(base, obj["video"], "video", allow_outside)
    else:
        audio, rel["audio"] = _resolve(base, obj["audio"], "audio", allow_outside)

    texts = [f for f in TEXT_FIELDS if obj.get(f) not in (None, "", [])]
    if not texts:
        raise _RowError("no_text", "no text; give 'caption' or 'text' (a string) or 'conversation' (a list of turns)")
    if len(texts) > 1:
        raise _RowError("bad_field", f"one text field per row, got {texts}")
    text_field = texts[0]
    text, conversation = None, ()
    if text_field == "conversation":
        turns = obj["conversation"]
        ok = isinstance(turns, list) and all(
            isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str)
            for t in turns)
        if not ok:
            raise _RowError("bad_field", "field 'conversation' must be a list of {\"role\": str, \"content\": str}")
        conversation = tuple({"role": t["role"], "content": t["content"]} for t in turns)
    else:
        text = obj[text_field]
        if not isinstance(text, str):
            raise _RowError("bad_field", f"field {text_field!r} must be a string, got {type(text).__name__}")

    sample_id = _sample_id(obj, source, line)
    known = set(MEDIA_FIELDS) | set(TEXT_FIELDS) | {"id"}
    extra = {k: obj[k] for k in sorted(obj) if k not in known}
    return MediaRow(source=source, line=line, record=record, id=sample_id, key=sample_key(sample_id),
                    images=images, video=video, audio=audio, rel=rel, text_field=text_field, text=text,
                    conversation=conversation, extra=extra)


def _sample_id(obj: dict, source: str, line: int) -> str:
    if "id" in obj and obj["id"] is not None:
        if not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool) or str(obj["id"]) == "":
            raise _RowError("bad_field", f"field 'id' must be a non-empty string or integer, got {_short(obj['id'])}")
        return str(obj["id"])
    return f"{Path(source).stem}-{line:08d}"


# ---------------------------------------------------------------------------------------------- chat rows

def _chat_image_path(part: dict, where: str) -> str:
    """The path of an OpenAI-style image part: ``{"type": "image_url", "image_url": {"url": P}}`` or
    ``{"type": "image", "path"|"url"|"image": P}``; ``file://`` URLs are paths, remote/inline images are refused."""
    if part.get("type") == "image_url":
        inner = part.get("image_url")
        value = inner.get("url") if isinstance(inner, dict) else inner
    else:
        value = next((part[k] for k in ("path", "url", "image") if k in part), None)
    if not isinstance(value, str) or not value.strip():
        raise _RowError("bad_field", f"{where}: an image part needs a path string (image_url.url or path), got "
                        f"{_short(value)}")
    if value.startswith("file://"):
        value = value[len("file://"):]
    elif "://" in value or value.startswith("data:"):
        raise _RowError("bad_field", f"{where}: image {_short(value)} is a URL; images are not fetched -- store "
                        "the file next to the manifest and give its relative path")
    return value


def _chat_content(content, where: str) -> tuple[str, list[str]]:
    """A message's content (a string, or a list of text/image parts) -> (text with IMAGE_PLACEHOLDER at each
    image, the images' paths as written)."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list):
        raise _RowError("bad_field", f"{where}: content must be a string or a list of parts, got {_short(content)}")
    text, paths = [], []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            if IMAGE_PLACEHOLDER in part["text"]:
                raise _RowError("bad_field", f"{at}: the text holds {IMAGE_PLACEHOLDER!r}, which marks where an "
                                "image goes; give images as image parts (or remove the string)")
            text.append(part["text"])
        elif kind in ("image_url", "image"):
            paths.append(_chat_image_path(part, at))
            text.append(IMAGE_PLACEHOLDER)
        else:
            raise _RowError("bad_field", f"{at}: expected {{\"type\": \"text\", \"text\": ...}} or an image part "
                            f"(\"image_url\" / \"image\"), got {_short(part)}")
    return "".join(text), paths


def _chat_record(obj: dict, base: Path, source: str, line: int, record: str, allow_outside: bool) -> MediaRow:
    """A chat SFT row: OpenAI ``messages`` whose user contents hold image parts, or LLaVA-style ShareGPT
    ``conversations`` with ``<image>`` in the text and the files in ``image`` (a path or a list); a row without
    images is a text-only conversation of the same set."""
    key = "messages" if "messages" in obj else "conversations"
    turns = obj[key]
    if not isinstance(turns, list) or not turns:
        raise _RowError("bad_field", f"field {key!r} must be a non-empty list of messages")
    messages, rel_paths = [], []
    for i, turn in enumerate(turns):
        where = f"{key}[{i}]"
        if not isinstance(turn, dict):
            raise _RowError("bad_field", f"{where} is not a message object")
        speaker, content = (turn.get("role"), turn.get("content")) if "role" in turn else \
            (turn.get("from"), turn.get("value"))
        role = _CHAT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise _RowError("bad_role", f"{where}: role {_short(speaker)}; roles are system/user/assistant "
                            "(ShareGPT: human/gpt)")
        text, paths = _chat_content(content, where)
        if key == "conversations" and paths:
            raise _RowError("bad_field", f"{where}: ShareGPT rows mark images with {IMAGE_PLACEHOLDER!r} in the text "
                            "and list the files in 'image'")
        count = len(paths) if key == "messages" else text.count(IMAGE_PLACEHOLDER)
        if count and role != "user":
            raise _RowError("bad_field", f"{where}: an image in a {role} message; images go in user turns (the "
                            "model reads them, it does not write them)")
        problem = message_weight(turn, role, where)
        if problem is not None:
            raise _RowError("bad_field", problem)
        # weight 0 (OpenAI's fine-tuning format): the message is context, never trained (media_chat)
        messages.append({"role": role, "content": text, **({"weight": 0} if turn.get("weight") == 0 else {})})
        rel_paths += paths
    if not any(m["role"] == "assistant" and m.get("weight", 1) != 0 for m in messages):
        raise _RowError("no_text", f"{key!r} has no assistant message to train on (weight 0 ones are not trained)")
    if key == "conversations":
        listed = obj.get("image", obj.get("images"))
        listed = [] if listed in (None, "") else [listed] if isinstance(listed, str) else listed
        if not isinstance(listed, list):
            raise _RowError("bad_field", f"field 'image' must be a path or a list of paths, got {_short(listed)}")
        marks = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages)
        if marks != len(listed):
            raise _RowError("bad_field", f"{marks} {IMAGE_PLACEHOLDER!r} placeholder(s) in the conversation for "
                            f"{len(listed)} image(s) in 'image'; put one placeholder in a user turn per image")
        rel_paths = listed
    elif obj.get("image", obj.get("images")) not in (None, "", []):
        raise _RowError("bad_field", "a 'messages' row gives its images as content parts of the user messages "
                        "(image_url / image); the 'image' field belongs to ShareGPT 'conversations' rows")
    resolved = [_resolve(base, v, "image", allow_outside) for v in rel_paths]  # extensions: media_codecs
    sample_id = _sample_id(obj, source, line)
    known = {key, "id", "image", "images"}
    extra = {k: obj[k] for k in sorted(obj) if k not in known}
    return MediaRow(source=source, line=line, record=record, id=sample_id, key=sample_key(sample_id),
                    images=tuple(r[0] for r in resolved), rel={"images": [r[1] for r in resolved]},
                    text_field="chat", conversation=tuple(messages), extra=extra)


def parse_json(record: str):
    """``json.loads`` with every failure as a _RowError: besides syntax errors, a number too long to
    convert (ValueError from Python's int digit limit) and nesting deep enough to exhaust the stack."""
    try:
        return json.loads(record)
    except json.JSONDecodeError as exc:
        raise _RowError("malformed_line", f"not valid JSON: {exc}") from None
    except RecursionError:
        raise _RowError("malformed_line", "not usable JSON: nested too deeply to parse") from None
    except ValueError:
        raise _RowError("malformed_line", f"not usable JSON: an integer with more than "
                        f"{sys.get_int_max_str_digits()} digits") from None


def _manifest_row(raw: bytes, base: Path, source: str, line_no: int, allow_outside: bool):
    """One manifest line -> MediaRow, Reject, or None for a blank line. Never raises for the line's content."""
    try:
        record = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        return Reject(source, line_no, "malformed_line", f"not UTF-8 (byte {exc.start} of the line); "
                      "re-encode the manifest", raw.decode("utf-8", "replace").rstrip("\r\n"))
    if not record.strip():
        return None  # blank lines are layout, not records
    try:
        obj = parse_json(record)
        check_values(obj)
        return parse_record(obj, base, source, line_no, record, allow_outside)
    except _RowError as exc:
        return Reject(source, line_no, exc.code, exc.reason, record)
    except Exception as exc:  # noqa: BLE001 - one hostile row must not stop the run; it is reported
        return Reject(source, line_no, "bad_field", f"cannot use this row ({type(exc).__name__}); "
                      "check its fields against the manifest format", record)


def _iter_manifest(path: Path, allow_outside: bool) -> Iterator[MediaRow | Reject]:
    base = path.parent
    source = str(path)
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            item = _manifest_row(raw, base, source, line_no, allow_outside)
            if item is not None:
                yield item


def _iter_folder(root: Path, allow_outside: bool = False) -> Iterator[MediaRow | Reject]:
    """A folder of media files with same-stem ``.txt`` captions, walked in sorted order.

    Hidden files and folders (a leading '.') are skipped: they are tool state, not data. A symlink is taken
    like the manifest path it stands for: one that leads out of the folder is refused (unless
    ``allow_outside``); a symlinked sub-folder is not walked (a link cycle would never end) but reported."""
    files, linked_dirs = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        visible = sorted(d for d in dirnames if not d.startswith("."))
        linked_dirs.extend(os.path.join(dirpath, d) for d in visible if os.path.islink(os.path.join(dirpath, d)))
        dirnames[:] = [d for d in visible if not os.path.islink(os.path.join(dirpath, d))]
        files.extend(os.path.join(dirpath, n) for n in filenames if not n.startswith("."))
    files.extend(linked_dirs)
    files.sort(key=lambda p: os.path.relpath(p, root))
    linked = set(linked_dirs)
    captions = {os.path.splitext(p)[0]: p for p in files if p.lower().endswith(".txt") and p not in linked}
    used_captions: set[str] = set()
    source = str(root)
    for ordinal, path in enumerate(files, 1):
        if path.lower().endswith(".txt") and path not in linked:
            continue
        rel = os.path.relpath(path, root)
        record = json.dumps({"file": rel})
        shown = _printable_name(rel)
        try:
            item = _folder_row(root, path, rel, ordinal, record, path in linked, captions, used_captions,
                               allow_outside)
        except _RowError as exc:
            item = Reject(source, ordinal, exc.code, f"{shown}: {exc.reason}", record)
        except Exception as exc:  # noqa: BLE001 - one odd file must not stop the run; it is reported
            item = Reject(source, ordinal, "bad_field", f"{shown}: cannot use this file "
                          f"({type(exc).__name__})", record)
        yield item
    for ordinal, path in enumerate(files, 1):
        if path.lower().endswith(".txt") and path not in used_captions and path not in linked:
            rel = os.path.relpath(path, root)
            yield Reject(source, ordinal, "no_media",
                         f"{_printable_name(rel)}: caption without a same-stem media file", json.dumps({"file": rel}))


def _printable_name(name: str) -> str:
    """A file name as text: bytes that are not UTF-8 (kept by os.walk as lone surrogates) shown as \\xNN."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _folder_row(root: Path, path: str, rel: str, ordinal: int, record: str, linked_dir: bool,
                captions: dict[str, str], used_captions: set[str], allow_outside: bool) -> MediaRow:
    source = str(root)
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise _RowError("bad_field", "the file name is not valid UTF-8; rename it") from None
    if linked_dir:
        raise _RowError("bad_field", "a symlink to a folder is not followed; link the files themselves or "
                        "list them in a manifest")
    real = os.path.realpath(path)
    if not allow_outside:
        _check_inside(real, str(root), "the symlink", "the input folder")
    stem = os.path.splitext(path)[0]
    kind = media_kind(path)
    if kind is None:
        raise _RowError("wrong_extension", "not a known image/audio/video extension; remove it or rename it")
    cap = captions.get(stem)
    if cap is None:
        raise _RowError("no_text", f"no caption file {os.path.relpath(stem, root)}.txt")
    used_captions.add(cap)
    if not allow_outside:
        _check_inside(os.path.realpath(cap), str(root), f"its caption {os.path.relpath(cap, root)!r}",
                      "the input folder")
    try:
        with open(cap, encoding="utf-8") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        detail = exc.strerror if isinstance(exc, OSError) else f"not UTF-8 at byte {exc.start}"
        raise _RowError("no_text", f"unreadable caption {os.path.relpath(cap, root)}: {detail}") from None
    sample_id = os.path.splitext(rel)[0].replace(os.sep, "/")
    rel_map = {"images": [rel]} if kind == "image" else {kind: rel}
    return MediaRow(source=source, line=ordinal, record=record, id=sample_id, key=sample_key(sample_id),
                    images=(real,) if kind == "image" else (), video=real if kind == "video" else None,
                    audio=real if kind == "audio" else None, rel=rel_map, text_field="caption", text=text)


def iter_rows(inputs: list[str], allow_outside: bool = False) -> Iterator[MediaRow | Reject]:
    """All inputs in order; the first row with a given key wins, later ones are rejected as duplicates."""
    seen: dict[str, tuple[str, int, str]] = {}
    for inp in inputs:
        path = Path(inp)
        items = _iter_folder(path, allow_outside) if path.is_dir() else _iter_manifest(path, allow_outside)
        for item in items:
            if isinstance(item, MediaRow):
                first = seen.get(item.key)
                if first is not None:
                    same = ("id" if first[2] == item.id
                            else f"key {item.key!r} (ids {_short(first[2])} and {_short(item.id)})")
                    item = Reject(item.source, item.line, "duplicate_id",
                                  f"duplicate {same}: first used at {first[0]}:{first[1]}; give each row a unique id",
                                  item.record)
                else:
                    seen[item.key] = (item.source, item.line, item.id)
            yield item


def input_fingerprint(inputs: list[str]) -> str:
    """Hash of the inputs' content (manifests) or listing (folders), to refuse resuming on changed input."""
    h = hashlib.sha256()
    for inp in inputs:
        p = Path(inp)
        h.update(str(p.resolve()).encode() + b"\0")
        if p.is_dir():
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames.sort()
                for n in sorted(filenames):
                    try:
                        size = os.stat(os.path.join(dirpath, n)).st_size
                    except OSError:  # a dangling symlink: its row is a reject, the listing still counts
                        size = -1
                    h.update(os.fsencode(os.path.relpath(os.path.join(dirpath, n), p)) + f"\0{size}\0".encode())
        else:
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()
