"""The multimodal task encoder: energon samples -> model inputs (placeholder tokens, pixels, waveforms, labels).

One sample becomes ``[media placeholders] [turn tokens ...] [eod]``, or for a chat sample (a conversation with
images in its user turns, rendered and masked at prep time) its chat-template tokens with each image slot
expanded to the image's placeholders: each image (video frames count as images)
is ``num_image_tokens`` copies of ``image_token_id``, each audio clip ``num_audio_tokens`` copies of
``audio_token_id``, media first (for captioning: the image, then the caption). Inputs are that sequence
without its last token, labels the sequence shifted by one; a label is ``-100`` where the target is a
placeholder or a non-assistant (prompt) turn, so the loss covers only what the model should write.

With ``pack=True`` energon's packing hooks put several samples into one sequence of ``seq_length`` tokens
(first-fit decreasing over the packing buffer); ``position_ids`` restart at 0 and ``document_ids`` count up
per sample, so attention can stay inside a sample. A sample is never split: the text of one longer than
``seq_length`` is cut at the end (its media never), and media alone over the budget is an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from megatron.energon import (Batch, CaptioningSample, Cooker, DefaultTaskEncoder, Sample, edataclass,
                              stateless)

from mmtrain.core.tokenizer import load_tokenizer
from mmtrain.data.multimodal_media import (IMAGE_SLOT, MediaSampleError, MediaTextSample, cook_media_sample,
                                           from_captioning)

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MultimodalSettings:
    """What the task encoder needs; ``tokenizer`` is a tokenizer file/folder (loaded lazily in each worker)
    or an object with ``encode(str) -> list[int]`` and ``eod_id``."""

    tokenizer: Any
    seq_length: int
    image_token_id: int
    num_image_tokens: int = 16
    image_size: int = 224
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    audio_token_id: int | None = None
    num_audio_tokens: int = 16
    audio_rate: int = 16000
    max_audio_seconds: float = 30.0
    video_frames: int = 4
    pad_id: int = 0
    pack: bool = False

    def __post_init__(self) -> None:
        if self.num_image_tokens < 1 or self.image_size < 1 or self.seq_length < 2:
            raise ValueError("multimodal settings: num_image_tokens, image_size must be >= 1 and seq_length >= 2")
        if self.num_image_tokens >= self.seq_length:
            raise ValueError(f"multimodal settings: num_image_tokens {self.num_image_tokens} leaves no room for text "
                             f"in seq_length {self.seq_length}; raise seq_length or lower num_image_tokens")


@edataclass
class EncodedMultimodalSample(Sample):
    """One sample (or one pack of samples) as model inputs, before padding: 1-D ``tokens``/``labels``/
    ``position_ids``/``document_ids`` of equal length, ``images`` (3, S, S) in placeholder order with their
    ``frame_index`` (int64, one per image: 0 for a still image, 0..k-1 for a video's frames), ``audio``
    (mono waveforms at ``audio_rate``) in placeholder order."""

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    images: list
    frame_index: torch.Tensor
    audio: list


@edataclass
class MultimodalBatch(Batch):
    """A micro-batch. ``tokens``/``labels``/``position_ids``/``document_ids``/``loss_mask``: (B, seq_length);
    padding has label -100, loss_mask 0, document id -1. ``images``: (N, 3, S, S), every image of the batch in
    row-major placeholder order; ``image_counts[b]`` images belong to row b; ``frame_index`` (N,) int64 each
    image's temporal row (video frame number, 0 for still images; all 0 when a caller leaves it out).
    ``audio``: (M, T) zero-padded waveforms with ``audio_lengths`` (M,) and ``audio_counts`` (B,), also in
    placeholder order."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    document_ids: torch.Tensor
    images: torch.Tensor
    image_counts: torch.Tensor
    audio: torch.Tensor
    audio_lengths: torch.Tensor
    audio_counts: torch.Tensor
    frame_index: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.frame_index is None:  # callers from before video frame indices: every image is a still
            self.frame_index = torch.zeros(len(self.images), dtype=torch.int64)


def _load_tokenizer(spec):
    if isinstance(spec, (str, os.PathLike)):
        return load_tokenizer(spec)
    return spec


class MultimodalTaskEncoder(DefaultTaskEncoder):
    """Energon task encoder for captioning sets and every ``mmtrain-prep media`` crude set (image, audio,
    video, mixed). Errors raise (``MediaSampleError`` names the sample); nothing is skipped silently."""

    def __init__(self, settings: MultimodalSettings) -> None:
        super().__init__()
        self.settings = settings
        self._tokenizer = None
        self._tokenizer_sha256 = None
        # A bound method keeps its function's @stateless mark, which energon requires of a cooker.
        self.cookers = [Cooker(self.cook_crude)]

    def __getstate__(self):  # tokenizers are loaded again in each worker process
        state = dict(self.__dict__)
        state["_tokenizer"] = None
        return state

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = _load_tokenizer(self.settings.tokenizer)
            if getattr(self._tokenizer, "eod_id", None) is None:
                raise ValueError(f"tokenizer {self.settings.tokenizer}: no end-of-sequence token; multimodal samples "
                                 "end with one -- use a tokenizer with an eos token")
        return self._tokenizer

    @stateless
    def cook_crude(self, sample: dict) -> MediaTextSample:
        return cook_media_sample(sample, self.settings.video_frames)

    # ---- one sample -------------------------------------------------------------------------------------

    def _image(self, image: torch.Tensor) -> torch.Tensor:
        s = self.settings
        image = F.interpolate(image[None].float(), size=(s.image_size, s.image_size), mode="bilinear",
                              antialias=True, align_corners=False)[0].clamp_(0.0, 1.0)
        mean = torch.tensor(s.image_mean).view(3, 1, 1)
        std = torch.tensor(s.image_std).view(3, 1, 1)
        return (image - mean) / std

    def _audio(self, wave: torch.Tensor, rate: int) -> torch.Tensor:
        s = self.settings
        if rate != s.audio_rate:  # linear resampling; store audio at the model's rate (--audio-rate) for quality
            n = max(1, round(wave.numel() * s.audio_rate / rate))
            wave = F.interpolate(wave.view(1, 1, -1), size=n, mode="linear", align_corners=False).view(-1)
        return wave[: int(s.max_audio_seconds * s.audio_rate)].contiguous()

    @stateless
    def encode_sample(self, sample) -> EncodedMultimodalSample:
        if isinstance(sample, CaptioningSample):
            sample = from_captioning(sample)
        if not isinstance(sample, MediaTextSample):
            raise MediaSampleError(f"sample {getattr(sample, '__key__', '?')!r}: {type(sample).__name__} is not "
                                   "supported; use a set written by mmtrain-prep media (captioning or crude)")
        s = self.settings
        if sample.audio and s.audio_token_id is None:
            raise MediaSampleError(f"sample {sample.__key__!r} has audio but no audio_token_id is set; set one "
                                   "(model.audio.enabled, model.audio_token_id) or leave audio sets out of the blend")
        if len(sample.frame_index) != len(sample.images):
            raise MediaSampleError(f"sample {sample.__key__!r}: {len(sample.frame_index)} frame indices for "
                                   f"{len(sample.images)} images; a cooker must give one per image (0 for a still)")
        if sample.chat_tokens is not None:
            ids, train, images = self._chat_sequence(sample)
        else:
            ids, train = self._turn_sequence(sample)
            images = sample.images
        seq = torch.tensor(ids, dtype=torch.int64)
        labels = seq[1:].clone()
        labels[~torch.tensor(train[1:], dtype=torch.bool)] = IGNORE_INDEX
        n = len(ids) - 1
        return EncodedMultimodalSample.derive_from(
            sample, tokens=seq[:-1], labels=labels, position_ids=torch.arange(n),
            document_ids=torch.zeros(n, dtype=torch.int64),
            images=[self._image(im) for im in images],
            frame_index=torch.tensor(sample.frame_index[:len(images)], dtype=torch.int64).view(-1),
            audio=[self._audio(w, r) for w, r in zip(sample.audio, sample.audio_rates)])

    def _turn_sequence(self, sample: MediaTextSample) -> tuple[list[int], list[bool]]:
        """Media placeholders first, then each turn's tokens, then eod; ``train``: which tokens are targets."""
        s = self.settings
        ids: list[int] = []
        train: list[bool] = []  # whether each token is a training target
        for _ in sample.images:
            ids += [s.image_token_id] * s.num_image_tokens
        for _ in sample.audio:
            ids += [s.audio_token_id] * s.num_audio_tokens
        train += [False] * len(ids)
        if len(ids) >= s.seq_length:
            raise MediaSampleError(f"sample {sample.__key__!r}: its {len(sample.images)} image(s) and "
                                   f"{len(sample.audio)} audio clip(s) take {len(ids)} tokens, at least the whole "
                                   f"seq_length {s.seq_length}; raise seq_length or lower the tokens per item")
        for role, text in sample.turns:
            toks = self.tokenizer.encode(text)
            ids += toks
            train += [role == "assistant"] * len(toks)
        ids.append(self.tokenizer.eod_id)
        train.append(sample.turns[-1][0] == "assistant")
        return ids[: s.seq_length + 1], train[: s.seq_length + 1]  # cut text only: media come first

    def _chat_sequence(self, sample: MediaTextSample) -> tuple[list[int], list[bool], list]:
        """The prepared chat tokens with each image slot expanded to ``num_image_tokens`` placeholders (never
        targets); ``train`` is the prep's loss mask. Longer than ``seq_length + 1``: cut there, or where the first
        image whose placeholders would not all be inputs (the first ``seq_length`` tokens) begins; that image and
        the later ones are dropped with the text (prepare with ``--max-length`` to reject such rows instead)."""
        s = self.settings
        self._check_chat_tokenizer(sample)
        ids: list[int] = []
        train: list[bool] = []
        kept = 0
        limit = s.seq_length + 1
        for token, target in zip(sample.chat_tokens, sample.chat_loss_mask):
            if token == IMAGE_SLOT:
                if len(ids) + s.num_image_tokens > s.seq_length:
                    break
                ids += [s.image_token_id] * s.num_image_tokens
                train += [False] * s.num_image_tokens
                kept += 1
            else:
                ids.append(token)
                train.append(bool(target))
        if len(ids) < 2:
            raise MediaSampleError(f"sample {sample.__key__!r}: its chat tokens leave fewer than 2 tokens in "
                                   f"seq_length {s.seq_length}; raise seq_length")
        return ids[:limit], train[:limit], sample.images[:kept]

    def _check_chat_tokenizer(self, sample: MediaTextSample) -> None:
        """Chat tokens are ids of the tokenizer the prep used: refuse them under another one (media.tokenizer)."""
        made_with = sample.chat_tokenizer_sha256
        checksum = getattr(self.tokenizer, "checksum", None)
        if made_with is None or checksum is None:
            return
        if self._tokenizer_sha256 is None:
            self._tokenizer_sha256 = checksum()
        if made_with != self._tokenizer_sha256:
            raise MediaSampleError(f"sample {sample.__key__!r} was prepared with another tokenizer (sha256 "
                                   f"{made_with[:12]}...) than media.tokenizer {self.settings.tokenizer} "
                                   f"({self._tokenizer_sha256[:12]}...); set media.tokenizer to the one the shards "
                                   "were prepared with (their manifest.json names it)")

    # ---- packing (active when the dataset is built with packing_buffer_size) ----------------------------

    @stateless
    def select_samples_to_pack(self, samples: list[EncodedMultimodalSample]) -> list[list[EncodedMultimodalSample]]:
        """First-fit decreasing into bins of ``seq_length`` tokens; ties keep buffer order (deterministic)."""
        budget = self.settings.seq_length
        order = sorted(range(len(samples)), key=lambda i: (-len(samples[i].tokens), i))
        bins: list[list[int]] = []
        room: list[int] = []
        for i in order:
            n = len(samples[i].tokens)
            for b, free in enumerate(room):
                if n <= free:
                    bins[b].append(i)
                    room[b] -= n
                    break
            else:
                bins.append([i])
                room.append(budget - n)
        return [[samples[i] for i in sorted(b)] for b in bins]

    @stateless
    def pack_selected_samples(self, samples: list[EncodedMultimodalSample]) -> EncodedMultimodalSample:
        return EncodedMultimodalSample(
            __key__=",".join(s.__key__ for s in samples), __restore_key__=(),
            __subflavors__=samples[0].__subflavors__,
            __sources__=tuple(src for s in samples for src in (s.__sources__ or ())),
            tokens=torch.cat([s.tokens for s in samples]), labels=torch.cat([s.labels for s in samples]),
            position_ids=torch.cat([s.position_ids for s in samples]),
            document_ids=torch.cat([torch.full_like(s.tokens, d) for d, s in enumerate(samples)]),
            images=[im for s in samples for im in s.images],
            frame_index=torch.cat([s.frame_index for s in samples]), audio=[a for s in samples for a in s.audio])

    # ---- batching -------------------------------------------------------------------------------------

    @stateless
    def batch(self, samples: list[EncodedMultimodalSample]) -> MultimodalBatch:
        s = self.settings
        b, length = len(samples), s.seq_length
        tokens = torch.full((b, length), s.pad_id, dtype=torch.int64)
        labels = torch.full((b, length), IGNORE_INDEX, dtype=torch.int64)
        position_ids = torch.zeros((b, length), dtype=torch.int64)
        document_ids = torch.full((b, length), -1, dtype=torch.int64)
        for row, x in enumerate(samples):
            n = len(x.tokens)
            tokens[row, :n], labels[row, :n] = x.tokens, x.labels
            position_ids[row, :n], document_ids[row, :n] = x.position_ids, x.document_ids
        images = [im for x in samples for im in x.images]
        audio = [a for x in samples for a in x.audio]
        audio_lengths = torch.tensor([a.numel() for a in audio], dtype=torch.int64)
        padded_audio = torch.zeros((len(audio), int(audio_lengths.max()) if audio else 0))
        for i, a in enumerate(audio):
            padded_audio[i, : a.numel()] = a
        return MultimodalBatch(
            __key__=[x.__key__ for x in samples], __restore_key__=(),
            __subflavors__=[x.__subflavors__ for x in samples],
            tokens=tokens, labels=labels, loss_mask=(labels != IGNORE_INDEX).float(), position_ids=position_ids,
            document_ids=document_ids,
            images=torch.stack(images) if images else torch.zeros((0, 3, s.image_size, s.image_size)),
            image_counts=torch.tensor([len(x.images) for x in samples], dtype=torch.int64),
            frame_index=torch.cat([x.frame_index for x in samples] or [torch.zeros(0, dtype=torch.int64)]),
            audio=padded_audio, audio_lengths=audio_lengths,
            audio_counts=torch.tensor([len(x.audio) for x in samples], dtype=torch.int64))

    @stateless
    def encode_batch(self, batch: MultimodalBatch) -> MultimodalBatch:
        return batch
