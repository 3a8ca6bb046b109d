"""The ``media:`` section of a VLM run: how image, audio and video samples are read and cooked.

Only what the data path alone decides lives here. What the model decides is read from the ``model:`` section
and never asked twice: the image size (``model.vision.image_size``), the placeholder token ids
(``model.image_token_id``, ``model.audio_token_id``), the placeholders per image (``model.tokens_per_image``,
derived from the vision shape and the projector's pixel shuffle), per audio clip (``model.audio.num_tokens``)
and the audio rate (``model.audio.sample_rate``). A GPT run has no ``media:`` section.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmtrain.config.schema import doc


@dataclass
class MediaConfig:
    """Media samples of a VLM run (``data.blend`` names their sources)."""

    tokenizer: str = doc("", "Tokenizer of the captions and turns (SentencePiece .model, tokenizer.json or its "
                             "folder), tokenized on the fly; the sources are data.blend: energon entries of a blend "
                             "spec, an energon metadataset YAML, or one mmtrain-prep media folder.")
    image_mean: list[float] = doc([0.5, 0.5, 0.5], "Per-channel mean subtracted from [0, 1] pixels.")
    image_std: list[float] = doc([0.5, 0.5, 0.5], "Per-channel std the pixels are divided by.", gt=0)
    max_audio_seconds: float = doc(30.0, "Waveforms are cut to this many seconds.", gt=0)
    video_frames: int = doc(4, "Evenly spaced frames taken from each video (each is an image).", ge=1)
    pack: bool = doc(False, "Pack several samples into each data.seq_length sequence (document ids and position "
                            "ids per sample).")
    packing_buffer_size: int = doc(32, "Samples the packer of each slice chooses from when filling sequences.", ge=1)
    shuffle_buffer_size: int = doc(100, "Energon's sample shuffle buffer of each slice; 0 disables it.", ge=0)
    slices: int = doc(16, "The data is read as this many slices (energon streams) in one fixed order; must be a "
                          "multiple of every data-parallel size the run uses or resumes at.", ge=1)


# The keys a VLM run's data section had before the media section, and what replaces each: an old YAML gets this
# in its "unknown config key" error (``mmtrain.config.loader``: a run config's ``MOVED_KEYS``).
_DERIVED = {"image_size": "model.vision.image_size", "image_token_id": "model.image_token_id",
            "num_image_tokens": "model.tokens_per_image (from model.vision.image_size, patch_size and "
                                "model.projector.pixel_shuffle)",
            "audio_token_id": "model.audio_token_id (with model.audio.enabled)",
            "num_audio_tokens": "model.audio.num_tokens", "audio_rate": "model.audio.sample_rate"}
MOVED_DATA_KEYS = {
    **{f"data.mm_{k}": f"the media path reads {v}; remove it"
       for k, v in _DERIVED.items()},
    **{f"data.mm_{k}": f"it is now media.{k}" for k in
       ("tokenizer", "image_mean", "image_std", "max_audio_seconds", "video_frames", "pack", "packing_buffer_size",
        "shuffle_buffer_size", "slices")},
}
