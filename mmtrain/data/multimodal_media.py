"""Crude `mmtrain-prep media` samples -> ``MediaTextSample`` (decoded images, waveforms, text turns).

Energon's decoder has already turned image parts into CHW float tensors and ``.wav/.flac/.mp3/.mp4/...`` parts
into lazy ``AVDecoder`` objects; ``.ogg`` (and any part energon leaves alone) arrives as bytes and is decoded
here with PyAV. Anything a sample lacks or cannot decode raises ``MediaSampleError`` naming the sample key.
"""

from __future__ import annotations

import io
import re
from typing import Any

import torch
from megatron.energon import CaptioningSample, Sample, edataclass

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
AUDIO_EXTS = ("wav", "flac", "mp3", "ogg", "opus", "m4a", "aac")
VIDEO_EXTS = ("mp4", "webm", "mkv", "mov", "avi")
_FRAME_PART = re.compile(r"^frame(\d+)\.(\w+)$")
_IMAGE_PART = re.compile(r"^img(\d+)\.(\w+)$")
IMAGE_SLOT = -1  # an image's place in a chat sample's tokens (dataprep.media_chat writes the same value)


class MediaSampleError(ValueError):
    """A sample that cannot be turned into model inputs; the message names the sample and the fix."""


@edataclass
class MediaTextSample(Sample):
    """One sample in media order: ``images`` (CHW float in [0, 1], video frames included), ``frame_index``
    (one int per image: 0 for a still image, 0..k-1 in time order for a video's k sampled frames; the ViT's
    temporal embedding row), ``audio`` (mono float waveforms at their ``audio_rates``) and ``turns`` of
    ``(role, text)``; only ``assistant`` turns are trained on (a caption is one assistant turn).

    A chat sample (`mmtrain-prep media` chat rows) has no turns but ``chat_tokens``, its chat-template tokens
    with ``IMAGE_SLOT`` where each image goes (in image order), and ``chat_loss_mask`` (1 = the token is a
    training target: the assistant's), of the same length."""

    images: list
    frame_index: list
    audio: list
    audio_rates: list
    turns: list
    chat_tokens: list | None = None
    chat_loss_mask: list | None = None
    chat_tokenizer_sha256: str | None = None  # the tokenizer.json the chat tokens were made with


def _where(sample: dict) -> str:
    return f"sample {sample.get('__key__')!r}"


def _as_image(value: Any, sample: dict, part: str) -> torch.Tensor:
    if isinstance(value, (bytes, bytearray)):  # an image format energon did not decode
        import numpy as np
        from PIL import Image

        try:
            with Image.open(io.BytesIO(value)) as im:
                value = torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0).permute(2, 0, 1)
        except Exception as exc:  # noqa: BLE001 - Pillow raises many types
            raise MediaSampleError(f"{_where(sample)}: part {part!r} is not a readable image ({exc})") from None
    if not isinstance(value, torch.Tensor) or value.ndim != 3:
        raise MediaSampleError(f"{_where(sample)}: part {part!r} did not decode to a CHW image "
                               f"(got {type(value).__name__})")
    if value.dtype == torch.uint8:
        value = value.float() / 255.0
    return value[:3] if value.shape[0] >= 3 else value.expand(3, -1, -1)


def _decode_audio_bytes(data: bytes, sample: dict, part: str) -> tuple[torch.Tensor, int]:
    import av
    import numpy as np

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = container.streams.audio[0]
            chunks = [f.to_ndarray().astype(np.float32).reshape(-1, f.samples) if f.format.is_planar
                      else f.to_ndarray().astype(np.float32).reshape(f.samples, -1).T
                      for f in container.decode(stream)]
            rate = stream.rate
    except Exception as exc:  # noqa: BLE001 - PyAV raises many types
        raise MediaSampleError(f"{_where(sample)}: audio part {part!r} cannot be decoded ({exc}); "
                               "re-run mmtrain-prep media on it") from None
    if not chunks:
        raise MediaSampleError(f"{_where(sample)}: audio part {part!r} holds no audio frames")
    return torch.from_numpy(np.concatenate(chunks, axis=1)), int(rate)


def _as_audio(value: Any, sample: dict, part: str) -> tuple[torch.Tensor, int]:
    if isinstance(value, (bytes, bytearray)):
        wave, rate = _decode_audio_bytes(bytes(value), sample, part)
    else:
        try:  # energon's AVDecoder
            clips = value.get_audio().audio_clips
            rate = value.get_audio_samples_per_second()
        except Exception as exc:  # noqa: BLE001
            raise MediaSampleError(f"{_where(sample)}: audio part {part!r} cannot be decoded ({exc})") from None
        if not clips:
            raise MediaSampleError(f"{_where(sample)}: audio part {part!r} holds no audio stream")
        wave = clips[0]
    wave = wave.float()
    if wave.ndim == 2:  # (channels, samples) -> mono; why: one waveform per clip keeps the batch simple
        wave = wave.mean(0)
    if wave.abs().max() > 1.5:  # integer PCM scale -> [-1, 1]
        wave = wave / 32768.0
    return wave, int(rate)


def _video_frames(sample: dict, part: str, count: int) -> list[torch.Tensor]:
    """``count`` evenly spaced frames: the JPEG frames prep stored (``--video-frames``), else decoded."""
    stored = sorted((int(m.group(1)), k) for k in sample if isinstance(k, str) and (m := _FRAME_PART.match(k)))
    if stored:
        frames = [_as_image(sample[k], sample, k) for _, k in stored]
    else:
        try:
            video = sample[part].get_frames(video_decode_audio=False).video_clips[0]  # (T, C, H, W)
        except Exception as exc:  # noqa: BLE001
            raise MediaSampleError(f"{_where(sample)}: video part {part!r} cannot be decoded ({exc})") from None
        frames = [_as_image(f, sample, part) for f in video]
    if not frames:
        raise MediaSampleError(f"{_where(sample)}: video part {part!r} has no frames")
    if len(frames) <= count:
        return frames
    return [frames[round(i * (len(frames) - 1) / max(count - 1, 1))] for i in range(count)]


def _turns(sample: dict) -> list[tuple[str, str]]:
    meta = sample.get("json") if isinstance(sample.get("json"), dict) else {}
    conversation = meta.get("conversation")
    if conversation:
        turns = []
        for i, turn in enumerate(conversation):
            if not isinstance(turn, dict) or not isinstance(turn.get("content"), str):
                raise MediaSampleError(f"{_where(sample)}: conversation turn {i} is not "
                                       "{role: ..., content: <text>}")
            turns.append((str(turn.get("role", "user")), turn["content"]))
        return turns
    text = sample.get("txt")
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if not isinstance(text, str):
        raise MediaSampleError(f"{_where(sample)}: no text (no .txt part and no conversation in .json); "
                               "every mmtrain-prep media sample has one -- was the set written by another tool?")
    return [("assistant", text)]


def _chat(sample: dict, images: int) -> tuple[list[int], list[int], str | None] | None:
    """A chat sample's (tokens, loss mask, tokenizer hash) from its ``json`` part, checked; None for other
    samples."""
    meta = sample.get("json") if isinstance(sample.get("json"), dict) else {}
    chat = meta.get("chat")
    if chat is None:
        return None
    tokens, mask = (chat.get(k) if isinstance(chat, dict) else None for k in ("tokens", "loss_mask"))
    ok = (isinstance(tokens, list) and isinstance(mask, list) and len(tokens) == len(mask)
          and all(type(t) is int and t >= IMAGE_SLOT for t in tokens) and all(m in (0, 1) for m in mask))
    if not ok:
        raise MediaSampleError(f"{_where(sample)}: its chat tokens / loss mask are not two equal-length lists of "
                               "token ids and 0/1; re-run mmtrain-prep media on the input")
    if tokens.count(IMAGE_SLOT) != images:
        raise MediaSampleError(f"{_where(sample)}: {tokens.count(IMAGE_SLOT)} image slots in its chat tokens for "
                               f"{images} image part(s); re-run mmtrain-prep media on the input")
    sha = chat.get("tokenizer_sha256")
    return tokens, mask, sha if isinstance(sha, str) else None


def cook_media_sample(sample: dict, video_frames: int) -> MediaTextSample:
    """A crude sample of any ``mmtrain_media`` subflavor -> ``MediaTextSample`` (parts in name order)."""
    images, frame_index, audio, rates = [], [], [], []
    for part in sorted(k for k in sample if isinstance(k, str) and not k.startswith("__")):
        ext = part.rsplit(".", 1)[-1].lower()
        if _FRAME_PART.match(part):
            continue  # read with their video
        if ext in IMAGE_EXTS and (part == ext or _IMAGE_PART.match(part)):
            images.append(_as_image(sample[part], sample, part))
            frame_index.append(0)
        elif ext in AUDIO_EXTS and part == ext:
            wave, rate = _as_audio(sample[part], sample, part)
            audio.append(wave)
            rates.append(rate)
        elif ext in VIDEO_EXTS and part == ext:
            frames = _video_frames(sample, part, video_frames)
            images.extend(frames)
            frame_index.extend(range(len(frames)))
    chat = _chat(sample, len(images))
    if not images and not audio and chat is None:  # a chat sample may be text only
        parts = sorted(k for k in sample if not str(k).startswith("__"))
        raise MediaSampleError(f"{_where(sample)}: no image, audio or video part among {parts}")
    if chat is not None and audio:
        raise MediaSampleError(f"{_where(sample)}: a chat sample with audio; chat rows hold images only")
    return MediaTextSample(__key__=sample["__key__"], __restore_key__=sample["__restore_key__"],
                           __subflavors__=sample.get("__subflavors__"), __sources__=sample.get("__sources__"),
                           images=images, frame_index=frame_index, audio=audio, audio_rates=rates,
                           turns=[] if chat else _turns(sample), chat_tokens=chat[0] if chat else None,
                           chat_loss_mask=chat[1] if chat else None,
                           chat_tokenizer_sha256=chat[2] if chat else None)


def from_captioning(sample: CaptioningSample) -> MediaTextSample:
    return MediaTextSample.derive_from(sample, images=[_as_image(sample.image, {"__key__": sample.__key__}, "image")],
                                       frame_index=[0], audio=[], audio_rates=[], turns=[("assistant", sample.caption)])

