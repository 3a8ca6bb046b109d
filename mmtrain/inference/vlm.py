"""VLM prompts for the decode engine: the prompt's token embeddings with its images / audio clips spliced in at
their placeholders (``VLMModel.embed_inputs``, as in training); decoding then runs the VLM's language model
(``DecodeEngine(vlm.language, ...)``), whose new tokens are plain text."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def vlm_prompt_embeds(vlm: nn.Module, prompt_ids: list[int], images: torch.Tensor | None = None,
                      audio: torch.Tensor | None = None, audio_lengths: torch.Tensor | None = None,
                      frame_index: torch.Tensor | None = None) -> torch.Tensor:
    """(S, D) embeddings of one prompt holding the placeholders of ``images`` (N, C, H, W) and ``audio``
    (M, samples) with ``audio_lengths``; pass them as ``Sequence(prompt_ids, params, prompt_embeds=...)``.
    A placeholder count that does not match the media raises ``MediaPlaceholderError``."""
    device = vlm.language.embed.weight.device
    tokens = torch.tensor([prompt_ids], device=device)
    n_img = 0 if images is None else len(images)
    n_aud = 0 if audio is None else len(audio)
    x = vlm.embed_inputs(tokens, images=images.to(device) if n_img else None,
                         image_counts=torch.tensor([n_img]), audio=audio.to(device) if n_aud else None,
                         audio_lengths=audio_lengths, audio_counts=torch.tensor([n_aud]), frame_index=frame_index)
    return x[0]
