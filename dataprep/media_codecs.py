"""Validate and (optionally) re-encode one sample's media: the work that runs in the worker processes.

Images are decoded with Pillow; audio and video with PyAV (FFmpeg). PyAV is what megatron-energon itself
uses to decode audio/video at load time, so a file that passes here also decodes there, and one wheel covers
WAV, FLAC, OGG (Vorbis/Opus), MP3 and every common video container; torchaudio 2.x no longer ships its own
decoders. Resampling uses ``torchaudio.functional.resample`` (imported only when asked for).

``pack_row`` never raises for bad media: it returns a `Packed` sample or a `(code, reason)` rejection.
"""

from __future__ import annotations

import io
import json
import os
import re
import struct
import wave
from collections.abc import Collection
from dataclasses import dataclass, field

from dataprep.media_manifest import AUDIO_EXTS, IMAGE_EXTS, VIDEO_EXTS, MediaRow

# Extensions we write for each Pillow format we keep as is (energon's image decoder knows all of these).
_FORMAT_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff"}
_CANON_EXT = {"jpeg": "jpg", "tif": "tiff", "oga": "ogg"}
# The complete (empty) IEND chunk every PNG ends with: type and CRC-32.
_PNG_IEND = b"IEND\xaeB`\x82"
# A decoded stream shorter than this share of its declared length is a truncated file.
_TRUNCATED_SHARE = 0.9
# Object reprs in library messages ("<_io.BytesIO object at 0x7f...>"): a memory address differs per run.
_OBJECT_REPR = re.compile(r"\s*<[^<>]*? at 0x[0-9a-fA-F]+>")
_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{8,}\b")


@dataclass(frozen=True)
class MediaOptions:
    image_format: str | None = None  # jpeg | webp | png; None keeps the original bytes
    max_side: int | None = None
    jpeg_quality: int = 90
    audio_rate: int | None = None
    mono: bool = False
    video_frames: int = 0
    max_file_bytes: int = 512 * 10**6
    max_image_pixels: int = 100_000_000
    fix_extensions: bool = False
    full_decode: bool = False  # decode every kept image in full (default: JPEG at 1/8 scale, PNG chunk CRCs)

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class SourceFile:
    """A part stored byte-for-byte as its source file: a worker sends this instead of the bytes, and the
    writer reads the file itself (cheaper than pickling megabytes through a pipe)."""

    path: str
    size: int


@dataclass
class Packed:
    """One sample ready for the tar: member name suffix (after ``key.``) -> bytes, plus its metadata."""

    key: str
    parts: dict[str, bytes | SourceFile]
    meta: dict
    kept: dict[str, str] = field(default_factory=dict)  # part -> source path, for parts kept as is

    @property
    def nbytes(self) -> int:
        return sum(v.size if isinstance(v, SourceFile) else len(v) for v in self.parts.values())

    def by_reference(self) -> Packed:
        parts = {k: SourceFile(self.kept[k], len(v)) if k in self.kept and isinstance(v, bytes) else v
                 for k, v in self.parts.items()}
        return Packed(self.key, parts, self.meta, self.kept)

    def resolve(self) -> dict[str, bytes]:
        """The parts as bytes; raises MediaReject if a referenced file changed after it was validated."""
        out = {}
        for k, v in self.parts.items():
            if isinstance(v, SourceFile):
                with open(v.path, "rb") as f:
                    data = f.read()
                if len(data) != v.size:
                    raise MediaReject("unreadable_media", f"{v.path}: changed while it was being packed")
                v = data
            out[k] = v
        return out


class MediaReject(Exception):
    def __init__(self, code: str, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


def stable_reason(text: str) -> str:
    """A reject reason without the parts that change from run to run (object reprs, memory addresses), so
    the same bad file gives the same rejects.jsonl line every time."""
    return _ADDRESS.sub("0x?", _OBJECT_REPR.sub("", text))


def _ext(path: str) -> str:
    ext = os.path.basename(path).rsplit(".", 1)[-1].lower() if "." in os.path.basename(path) else ""
    return _CANON_EXT.get(ext, ext)


def _checked_ext(path: str, rel: str, allowed: Collection[str], kind: str) -> str:
    """The file's canonical extension, or a ``wrong_extension`` reject when it is not one of ``allowed``."""
    ext = _ext(path)
    if ext not in {_CANON_EXT.get(e, e) for e in allowed}:
        raise MediaReject("wrong_extension", f"{rel}: .{ext} is not {kind} extension ({', '.join(sorted(allowed))})")
    return ext


def _read(path: str, rel: str, opts: MediaOptions) -> bytes:
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise MediaReject("missing_file", f"{rel}: file not found") from None
    except OSError as exc:
        raise MediaReject("unreadable_media", f"{rel}: cannot stat: {exc}") from None
    if size == 0:
        raise MediaReject("empty_file", f"{rel}: zero-byte file")
    if size > opts.max_file_bytes:
        raise MediaReject("too_large", f"{rel}: {size} bytes is over --max-file-mb "
                          f"({opts.max_file_bytes / 1e6:g} MB); raise the limit or drop the file")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise MediaReject("unreadable_media", f"{rel}: cannot read: {exc}") from None


# ----------------------------------------------------------------------------------------------- images

def pack_image(path: str, rel: str, opts: MediaOptions) -> tuple[str, bytes, dict]:
    from PIL import Image, ImageOps

    ext = _checked_ext(path, rel, IMAGE_EXTS, "an image")
    data = _read(path, rel, opts)
    Image.MAX_IMAGE_PIXELS = opts.max_image_pixels
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = "JPEG" if im.format == "MPO" else im.format  # MPO: phone JPEGs with extra frames
            w, h = im.size
            if w * h > opts.max_image_pixels:
                raise MediaReject("too_large", f"{rel}: {w}x{h} pixels is over --max-image-pixels")
            reencode = opts.image_format is not None or (opts.max_side is not None and max(w, h) > opts.max_side)
            if reencode or opts.full_decode or fmt not in ("JPEG", "PNG"):
                im.load()  # decodes the whole stream: truncated or corrupt data fails here
            elif fmt == "JPEG":
                # Validation only: a 1/8-scale JPEG decode still reads every entropy-coded bit (truncated or
                # corrupt data fails the same way) but skips most of the inverse DCT: ~40% less time.
                im.draft("RGB" if im.mode == "RGB" else im.mode, (max(1, w // 8), max(1, h // 8)))
                im.load()
            else:
                # PNG kept as is: check every chunk's CRC-32 through IEND (a file cut short or with any byte
                # changed after it was written fails), ~15x cheaper than inflating the pixels; only a file
                # its encoder wrote wrong with correct CRCs gets past this (--full-decode catches that too).
                im.verify()
            if fmt == "PNG" and data.rfind(_PNG_IEND) < 0:  # neither check above looks past IEND's type
                raise MediaReject("truncated_media", f"{rel}: PNG file cut short: no complete IEND chunk")
            if fmt not in _FORMAT_EXT:
                raise MediaReject("unreadable_media",
                                  f"{rel}: {fmt} images are not supported; convert to JPEG/PNG/WEBP")
            if IMAGE_EXTS.get(ext) != fmt and not reencode:
                if not opts.fix_extensions:
                    raise MediaReject("wrong_extension", f"{rel}: extension .{ext} but the content is {fmt}; "
                                      "rename the file or pass --fix-extensions")
            if not reencode:
                return _FORMAT_EXT[fmt], data, {"width": w, "height": h, "format": fmt, "bytes": len(data)}
            out_fmt = (opts.image_format or ("PNG" if fmt not in ("JPEG", "WEBP", "PNG") else fmt)).upper()
            out_fmt = "JPEG" if out_fmt == "JPG" else out_fmt
            img = ImageOps.exif_transpose(im)
            if opts.max_side is not None and max(img.size) > opts.max_side:
                scale = opts.max_side / max(img.size)
                img = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                                 Image.Resampling.LANCZOS)
            if out_fmt == "JPEG" and img.mode not in ("RGB", "L"):
                img = img.convert("RGB")
            elif img.mode not in ("RGB", "RGBA", "L", "LA"):
                img = img.convert("RGBA" if "A" in img.getbands() or "transparency" in img.info else "RGB")
            buf = io.BytesIO()
            save_kw = {"JPEG": {"quality": opts.jpeg_quality}, "WEBP": {"quality": opts.jpeg_quality, "method": 4},
                       "PNG": {"compress_level": 6}}[out_fmt]
            img.save(buf, format=out_fmt, **save_kw)
            out = buf.getvalue()
            return _FORMAT_EXT[out_fmt], out, {"width": img.width, "height": img.height, "format": out_fmt,
                                               "bytes": len(out), "source_format": fmt, "source_size": [w, h]}
    except MediaReject:
        raise
    except Image.DecompressionBombError as exc:
        raise MediaReject("too_large", f"{rel}: {exc}") from None
    except (OSError, SyntaxError, ValueError) as exc:
        msg = str(exc)
        code = "truncated_media" if "truncated" in msg.lower() else "unreadable_media"
        raise MediaReject(code, f"{rel}: cannot decode image: {msg}") from None


# ------------------------------------------------------------------------------------------------ audio

def _wav_declared_frames(data: bytes) -> tuple[int, int] | None:
    """(declared data bytes, block align) from a RIFF/WAVE header, or None if it is not one."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos, align = 12, None
    while pos + 8 <= len(data):
        cid, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        if cid == b"fmt " and pos + 22 <= len(data):
            align = struct.unpack("<H", data[pos + 20:pos + 22])[0]
        if cid == b"data":
            return size, align or 1
        pos += 8 + size + (size & 1)
    return None


def _decode_audio(data: bytes, rel: str, want_pcm: bool):
    import av
    import numpy as np

    try:
        with av.open(io.BytesIO(data)) as c:
            if not c.streams.audio:
                raise MediaReject("unreadable_media", f"{rel}: no audio stream")
            s = c.streams.audio[0]
            rate = s.rate or s.codec_context.sample_rate
            declared = (float(s.duration * s.time_base) if s.duration and s.time_base
                        else (c.duration / 1e6 if c.duration else None))
            channels = s.codec_context.channels if hasattr(s.codec_context, "channels") else s.channels
            codec = s.codec_context.name
            n, chunks = 0, []
            resampler = av.AudioResampler(format="fltp", layout=s.layout.name, rate=rate) if want_pcm else None
            for frame in c.decode(s):
                n += frame.samples
                if resampler is not None:
                    chunks.extend(f.to_ndarray() for f in resampler.resample(frame))
            if resampler is not None:
                chunks.extend(f.to_ndarray() for f in resampler.resample(None))
    except MediaReject:
        raise
    except EOFError as exc:
        raise MediaReject("truncated_media", f"{rel}: audio ends early: {exc}") from None
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise MediaReject("unreadable_media", f"{rel}: cannot decode audio: {exc}") from None
    if n == 0 or not rate:
        raise MediaReject("unreadable_media", f"{rel}: no audio samples decoded")
    decoded = n / rate
    wav = _wav_declared_frames(data)
    if wav is not None:
        declared_bytes, align = wav
        header_end = data.find(b"data") + 8
        if len(data) - header_end < declared_bytes:
            raise MediaReject("truncated_media", f"{rel}: WAV header declares {declared_bytes} data bytes, "
                              f"the file holds {len(data) - header_end}")
    elif declared and decoded < _TRUNCATED_SHARE * declared - 0.05:
        raise MediaReject("truncated_media", f"{rel}: header says {declared:.2f}s, only {decoded:.2f}s decode")
    pcm = np.concatenate(chunks, axis=1) if chunks else None
    return {"sample_rate": rate, "channels": channels, "duration": round(decoded, 6), "codec": codec}, pcm


def _to_wav(pcm, rate: int) -> bytes:
    import numpy as np

    ints = (np.clip(pcm, -1.0, 1.0) * 32767.0).round().astype("<i2").T  # (samples, channels)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(ints.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.ascontiguousarray(ints).tobytes())
    return buf.getvalue()


def pack_audio(path: str, rel: str, opts: MediaOptions) -> tuple[str, bytes, dict]:
    ext = _checked_ext(path, rel, AUDIO_EXTS, "an audio")
    data = _read(path, rel, opts)
    convert = opts.audio_rate is not None or opts.mono
    info, pcm = _decode_audio(data, rel, want_pcm=convert)
    if not convert:
        return ext, data, {**info, "format": ext, "bytes": len(data)}
    import torch
    import torchaudio.functional as AF

    wave_t = torch.from_numpy(pcm)
    if opts.mono and wave_t.shape[0] > 1:
        wave_t = wave_t.mean(dim=0, keepdim=True)
    rate = info["sample_rate"]
    if opts.audio_rate is not None and opts.audio_rate != rate:
        wave_t = AF.resample(wave_t, rate, opts.audio_rate)
        rate = opts.audio_rate
    out = _to_wav(wave_t.numpy(), rate)
    return "wav", out, {"sample_rate": rate, "channels": int(wave_t.shape[0]),
                        "duration": round(wave_t.shape[1] / rate, 6), "format": "wav", "bytes": len(out),
                        "source": info}


# ------------------------------------------------------------------------------------------------ video

def pack_video(path: str, rel: str, opts: MediaOptions) -> tuple[str, bytes, dict, list[bytes]]:
    import av

    ext = _ext(path)
    if ext not in VIDEO_EXTS:
        raise MediaReject("wrong_extension",
                          f"{rel}: .{ext} is not a video extension ({', '.join(sorted(VIDEO_EXTS))})")
    data = _read(path, rel, opts)
    frames: list = []
    try:
        with av.open(io.BytesIO(data)) as c:
            if not c.streams.video:
                raise MediaReject("unreadable_media", f"{rel}: no video stream")
            v = c.streams.video[0]
            fps = float(v.average_rate) if v.average_rate else None
            declared = v.frames or None
            duration = (float(v.duration * v.time_base) if v.duration and v.time_base
                        else (c.duration / 1e6 if c.duration else None))
            info = {"codec": v.codec_context.name, "width": v.codec_context.width, "height": v.codec_context.height,
                    "fps": fps, "has_audio": bool(c.streams.audio)}
            packets, decoded_any = 0, False
            for pkt in c.demux(v):
                if pkt.size == 0:
                    continue
                packets += 1
                if opts.video_frames or not decoded_any:
                    for frame in pkt.decode():
                        decoded_any = True
                        if opts.video_frames:
                            frames.append(frame.to_image())
            if opts.video_frames or not decoded_any:
                for frame in v.codec_context.decode(None):
                    decoded_any = True
                    if opts.video_frames:
                        frames.append(frame.to_image())
    except MediaReject:
        raise
    except EOFError as exc:
        raise MediaReject("truncated_media", f"{rel}: video ends early: {exc}") from None
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise MediaReject("unreadable_media", f"{rel}: cannot read video: {exc}") from None
    if not decoded_any or packets == 0:
        raise MediaReject("unreadable_media", f"{rel}: no video frame decodes")
    if declared and packets < _TRUNCATED_SHARE * declared:
        raise MediaReject("truncated_media", f"{rel}: header declares {declared} frames, only {packets} are present")
    if duration is None and fps:
        duration = packets / fps
    info.update(frames=packets, duration=round(duration, 6) if duration else None, format=ext, bytes=len(data))
    stills = []
    if opts.video_frames and frames:
        k = min(opts.video_frames, len(frames))
        picks = [round(i * (len(frames) - 1) / max(k - 1, 1)) for i in range(k)]
        for i in picks:
            buf = io.BytesIO()
            frames[i].convert("RGB").save(buf, format="JPEG", quality=opts.jpeg_quality)
            stills.append(buf.getvalue())
        info["sampled_frames"] = picks
    return ext, data, info, stills


# ------------------------------------------------------------------------------------------------- rows

def _meta_base(row: MediaRow) -> dict:
    meta = {"id": row.id, "source": os.path.basename(row.source), "line": row.line, "modality": row.modality,
            "media": row.rel}
    if row.text_field == "conversation":
        meta["conversation"] = list(row.conversation)
    elif row.text_field == "chat":  # the messages as rendered (IMAGE_PLACEHOLDER at the images) and their tokens
        meta["messages"] = list(row.conversation)
        meta["chat"] = row.chat
    else:
        meta[row.text_field] = row.text
    if row.extra:
        meta["extra"] = row.extra
    return meta


def pack_row(row: MediaRow, opts: MediaOptions) -> Packed | tuple[str, str]:
    """The sample's tar parts (``jpg``/``png``..., ``img000.jpg``..., ``flac``/``wav``..., ``mp4``...,
    ``frame000.jpg``..., ``txt`` for caption/text, ``json`` metadata), or ``(code, reason)``."""
    try:
        parts: dict[str, bytes] = {}
        kept: dict[str, str] = {}
        meta = _meta_base(row)
        if row.images:
            infos = []
            for i, (path, rel) in enumerate(zip(row.images, row.rel["images"])):
                ext, data, info = pack_image(path, rel, opts)
                name = ext if len(row.images) == 1 else f"img{i:03d}.{ext}"
                parts[name] = data
                if "source_format" not in info:
                    kept[name] = path
                infos.append(info)
            meta["images"] = infos
        elif row.audio:
            ext, data, info = pack_audio(row.audio, row.rel["audio"], opts)
            parts[ext] = data
            if "source" not in info:
                kept[ext] = row.audio
            meta["audio"] = info
        elif row.video:
            ext, data, info, stills = pack_video(row.video, row.rel["video"], opts)
            parts[ext] = data
            kept[ext] = row.video
            for i, still in enumerate(stills):
                parts[f"frame{i:03d}.jpg"] = still
            meta["video"] = info
        if row.text is not None:
            parts["txt"] = row.text.encode("utf-8")
        parts["json"] = json.dumps(meta, ensure_ascii=False, sort_keys=True).encode("utf-8")
        return Packed(row.key, parts, meta, kept)
    except MediaReject as exc:
        return exc.code, stable_reason(exc.reason)
    except Exception as exc:  # noqa: BLE001 - a decoder bug on one file must not stop the run; it is reported
        return "unreadable_media", stable_reason(f"unexpected {type(exc).__name__} while packing: {exc}"[:300])


def pack_batch(batch: list[tuple[MediaRow, MediaOptions]], by_reference: bool = False
               ) -> list[Packed | tuple[str, str]]:
    """Worker entry point: several rows per task, so process hand-offs stay cheap for small files.
    ``by_reference``: parts kept byte-for-byte travel back as `SourceFile`s (see there)."""
    results = [pack_row(row, opts) for row, opts in batch]
    if by_reference:
        results = [r.by_reference() if isinstance(r, Packed) else r for r in results]
    return results
