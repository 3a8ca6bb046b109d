"""``MediaBatch``: a multimodal micro-batch as plain tensors, without importing megatron-energon.

It has the fields of ``mmtrain.data.multimodal.MultimodalBatch`` (the energon batch the task encoder makes), so
the training step, the benchmarks (whose machine has no energon) and text-only rows share one type. Rows of
text-only samples simply have ``image_counts == 0`` and ``audio_counts == 0``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

IGNORE_INDEX = -100


@dataclass
class MediaBatch:
    """``tokens``/``labels``/``loss_mask``/``position_ids``/``document_ids``: (B, S); labels are -100 where no
    loss is taken. ``images`` (N, 3, H, W) in row-major placeholder order, ``image_counts`` (B,), ``frame_index``
    (N,) int64 each image's temporal row (a video frame's number, 0 for a still; zeros when left out);
    ``audio`` (M, T) zero-padded waveforms, ``audio_lengths`` (M,), ``audio_counts`` (B,)."""

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
            self.frame_index = torch.zeros(self.images.shape[0], dtype=torch.int64)

    @classmethod
    def of(cls, batch) -> MediaBatch:
        """From any object with these fields (an energon ``MultimodalBatch``; ``frame_index`` may be missing)."""
        return cls(**{f.name: getattr(batch, f.name, None) if f.name == "frame_index" else getattr(batch, f.name)
                      for f in fields(cls)})

    def to(self, device: torch.device, non_blocking: bool = True) -> MediaBatch:
        return MediaBatch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                             for f in fields(self)})

    @property
    def num_images(self) -> int:
        return int(self.image_counts.sum())

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def text_rows(tokens_BS1: torch.Tensor, image_size: int, positions: torch.Tensor | None = None,
              doc_ids: torch.Tensor | None = None, loss_mask: torch.Tensor | None = None) -> MediaBatch:
    """Text-only rows from GPT samples of ``seq_length + 1`` tokens: inputs, shifted labels, no media."""
    tokens_BS1 = torch.as_tensor(tokens_BS1, dtype=torch.int64)
    inputs, labels = tokens_BS1[:, :-1].clone(), tokens_BS1[:, 1:].clone()
    B, S = inputs.shape
    if loss_mask is None:
        loss_mask = torch.ones(B, S)
    labels[loss_mask == 0] = IGNORE_INDEX
    return MediaBatch(
        tokens=inputs, labels=labels, loss_mask=loss_mask.float(),
        position_ids=torch.arange(S).expand(B, S).clone() if positions is None else positions,
        document_ids=torch.zeros(B, S, dtype=torch.int64) if doc_ids is None else doc_ids,
        images=torch.zeros(0, 3, image_size, image_size), image_counts=torch.zeros(B, dtype=torch.int64),
        frame_index=torch.zeros(0, dtype=torch.int64),
        audio=torch.zeros(0, 0), audio_lengths=torch.zeros(0, dtype=torch.int64),
        audio_counts=torch.zeros(B, dtype=torch.int64))


def _cat(tensors: list[torch.Tensor], pin: bool) -> torch.Tensor:
    if not pin:
        return torch.cat(tensors)
    # straight into pinned memory from the caching host allocator: no page faults on a fresh 448 px image batch
    # (~20 MB a step) and no second copy before the asynchronous one to the device
    shape = (sum(t.shape[0] for t in tensors), *tensors[0].shape[1:])
    return torch.cat(tensors, out=torch.empty(shape, dtype=tensors[0].dtype, pin_memory=True))


def concat_rows(parts: list[MediaBatch], pin: bool = False) -> MediaBatch:
    """Rows of several batches as one, in order (images and audio stay in row-major placeholder order); ``pin``:
    in pinned host memory (for a CUDA run's copies, ``mmtrain.utils.host_copy.to_device``)."""
    longest = max((p.audio.shape[1] for p in parts), default=0)
    audio = [torch.nn.functional.pad(p.audio, (0, longest - p.audio.shape[1])) for p in parts]
    cat = {f.name: _cat([getattr(p, f.name) for p in parts], pin) for f in fields(MediaBatch) if f.name != "audio"}
    return MediaBatch(audio=_cat(audio, pin) if audio else torch.zeros(0, 0), **cat)
