"""``python -m mmtrain.convert compare``: a Hugging Face model and an mmtrain checkpoint on the same input, fp32.

Both models are built on the CPU in fp32: the HF one with ``transformers`` from ``--hf``, ours from the
checkpoint's full tensors (any saved layout). The input: ``--image`` (resized to the tower's size, scaled
to [-1, 1]; deterministic noise without it), ``--audio`` (for a Whisper folder: any file PyAV decodes, downmixed
and resampled; its log-mel features from mmtrain's front end, cut or padded to the encoder's length; Whisper takes
the same features; read before any model is built) and ``--text`` (the HF folder's
tokenizer when it has one, else the UTF-8 bytes modulo the vocabulary), placeholders for the image before the
text. Printed: the max |difference| of each part's features and of the logits; ``compare`` returns the largest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mmtrain.convert.checkpoint_io import ConvertError, read_full_state
from mmtrain.convert.hf_files import read_hf_config
from mmtrain.convert.vlm_convert import part_module, read_vlm_checkpoint
from mmtrain.models.vlm import VLMModel


def _hf_model(hf_dir: str | Path, kind: str):
    import transformers  # only the comparison needs it

    classes = {"llava": "LlavaForConditionalGeneration", "clip_vision_model": "CLIPVisionModel",
               "siglip_vision_model": "SiglipVisionModel", "whisper": "WhisperModel"}
    cls = getattr(transformers, classes.get(kind, "AutoModelForCausalLM"))
    return cls.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


def _image(path: str | None, size: int) -> torch.Tensor:
    if path is None:
        return torch.rand(1, 3, size, size, generator=torch.Generator().manual_seed(0)) * 2 - 1
    from PIL import Image

    try:
        img = Image.open(path).convert("RGB").resize((size, size), Image.BICUBIC)
    except OSError as exc:
        raise ConvertError(f"--image {path}: not a readable image ({exc})") from None
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(size, size, 3).permute(2, 0, 1)
    return (x.float() / 127.5 - 1)[None]


def _text_ids(hf_dir: str | Path, text: str, vocab: int, avoid: set[int]) -> list[int]:
    folder = Path(hf_dir)
    if any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        import transformers

        ids = transformers.AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"]
    else:
        ids = list(text.encode("utf-8"))
    return [i % vocab if i % vocab not in avoid else 0 for i in ids]


def _read_audio(path: str) -> tuple[torch.Tensor, int]:
    """(channels, samples) in [-1, 1] and the rate of the file's first audio stream, decoded by PyAV (FFmpeg:
    WAV, FLAC, MP3, ...), as ``mmtrain-prep media`` reads audio; torchaudio's own loader needs TorchCodec."""
    import av
    import numpy as np

    try:
        with av.open(path) as container:
            stream = container.streams.audio[0]
            chunks = []
            for frame in container.decode(stream):
                x = frame.to_ndarray()
                x = x.reshape(-1, frame.samples) if frame.format.is_planar else x.reshape(frame.samples, -1).T
                if np.issubdtype(x.dtype, np.unsignedinteger):  # u8: offset binary
                    x = (x.astype(np.float32) - 128.0) / 128.0
                elif np.issubdtype(x.dtype, np.integer):  # s16 / s32 PCM -> [-1, 1]
                    x = x.astype(np.float32) / float(np.iinfo(x.dtype).max + 1)
                chunks.append(x.astype(np.float32))
            rate = int(stream.rate)
    except (IndexError, av.FFmpegError, OSError, ValueError) as exc:
        reason = "it has no audio stream" if isinstance(exc, IndexError) else str(exc)
        raise ConvertError(f"--audio {path}: not a readable audio file ({reason})") from None
    if not chunks:
        raise ConvertError(f"--audio {path}: the file holds no audio frames")
    return torch.from_numpy(np.concatenate(chunks, axis=1)), rate


def _mel(audio: tuple[torch.Tensor, int] | None, audio_enc, frames: int) -> torch.Tensor:
    """The encoder's log-mel input: ``frames`` frames of ``audio`` (``_read_audio``'s; mono, at the encoder's
    rate, cut or padded with zeros), or deterministic noise features without it."""
    n_mels = audio_enc.cfg.n_mels
    if audio is None:
        return torch.randn(1, n_mels, frames, generator=torch.Generator().manual_seed(1))
    import torchaudio

    wave, rate = audio
    wave = torchaudio.functional.resample(wave.mean(0, keepdim=True), rate, audio_enc.cfg.sample_rate)
    mel = audio_enc.log_mel(wave)[..., :frames]
    return torch.nn.functional.pad(mel, (0, frames - mel.shape[-1]))


def _diff(a: torch.Tensor, b: torch.Tensor, what: str) -> float:
    if a.shape != b.shape:
        raise ConvertError(f"{what}: shapes differ (HF {tuple(a.shape)}, mmtrain {tuple(b.shape)}); is --ckpt a "
                           "conversion of --hf?")
    return float((a.float() - b.float()).abs().max())


@torch.no_grad()
def compare(hf_dir: str | Path, ckpt: str | Path, image: str | None = None, audio: str | None = None,
            text: str = "a photo of", printer=print) -> float:
    """Run both models and print per-part max |diff|; returns the largest."""
    hf_config: dict[str, Any] = read_hf_config(hf_dir)
    kind = hf_config.get("model_type")
    if audio is not None and kind != "whisper":
        raise ConvertError(f"--audio {audio}: --hf {hf_dir} is a {kind!r} model; --audio is for a Whisper encoder")
    waveform = _read_audio(audio) if audio is not None else None  # a bad file fails before any model is loaded
    hf = _hf_model(hf_dir, kind)
    diffs: dict[str, float] = {}
    if kind in ("llava", "clip_vision_model", "siglip_vision_model", "whisper"):
        full, cfg, _, parts = read_vlm_checkpoint(ckpt)
        if kind == "whisper":
            ours = part_module(cfg, "audio").eval()
            ours.load_state_dict({k.removeprefix("audio."): v for k, v in full.items()})
            mel = _mel(waveform, ours, 2 * cfg.audio.max_frames)
            diffs["audio features"] = _diff(hf.encoder(mel).last_hidden_state, ours.encode_log_mel(mel), "audio")
        elif kind != "llava":
            ours = part_module(cfg, "vision").eval()
            ours.load_state_dict({k.removeprefix("vision."): v for k, v in full.items()})
            px = _image(image, cfg.vision.image_size)
            diffs["vision features"] = _diff(hf(pixel_values=px).last_hidden_state, ours(px), "vision")
        else:
            ours = VLMModel(cfg).eval()
            ours.load_state_dict(full, strict=False)
            px = _image(image, cfg.vision.image_size)
            layer = hf.config.vision_feature_layer
            feats = hf.model.vision_tower(pixel_values=px, output_hidden_states=True).hidden_states[layer]
            if hf.config.vision_feature_select_strategy == "default":
                feats = feats[:, 1:]
            diffs["vision features"] = _diff(feats, ours.vision(px), "vision")
            diffs["projector"] = _diff(hf.model.multi_modal_projector(feats), ours.encode_images(px), "projector")
            ids = [cfg.image_token_id] * cfg.tokens_per_image + _text_ids(
                hf_dir, text, cfg.language.vocab_size, {cfg.image_token_id})
            tokens = torch.tensor([ids])
            diffs["logits"] = _diff(hf(input_ids=tokens, pixel_values=px).logits,
                                    ours(tokens, images=px, image_counts=torch.tensor([1])), "logits")
    else:
        from mmtrain.models.registry import model_family

        full, cfg, _ = read_full_state(ckpt)
        ours = model_family(cfg).build_stage(cfg, (0, cfg.shape().num_layers), True, True).eval()
        ours.load_state_dict(full, strict=False)
        tokens = torch.tensor([_text_ids(hf_dir, text, hf.config.vocab_size, set())])
        diffs["logits"] = _diff(hf(input_ids=tokens).logits, ours(tokens), "logits")
    for what, d in diffs.items():
        printer(f"{what}: max |diff| = {d:.3e}")
    return max(diffs.values())
