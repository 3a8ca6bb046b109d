"""Cross-field checks of a VLM run config, before any process group is made; each names the key to fix."""

from __future__ import annotations

from pathlib import Path

from mmtrain.config.family_sections import families_with
from mmtrain.config.loader import ConfigError
from mmtrain.config.ranges import check_ranges
from mmtrain.config.validate import check_language_run
from mmtrain.config.vlm_run_schema import COMPONENTS, VLMRunConfig
from mmtrain.config.vlm_schema import check_vlm_model


def validate_vlm_config(cfg: VLMRunConfig, world_size: int | None = None) -> None:
    """Raise ``ConfigError`` on impossible combinations (the GPT run's checks of the language model, named
    ``model.language``, the VLM shape, the media section, the layout the VLM supports, ``freeze`` and
    ``lr_scale``)."""
    p, d, media = cfg.parallel, cfg.data, cfg.media
    check_ranges(cfg)  # every numeric field, the VLM model's and media's included, named by its own key
    if not cfg.model.language.shape().vlm_language:  # a family the VLM can splice media into
        raise ConfigError(f"model.language.family={cfg.model.language.family}: a VLM run's language model must be "
                          f"model.language.family={' or '.join(families_with('vlm_language'))}")
    if p.fsdp:
        raise ConfigError("parallel.fsdp=true is not supported for the VLM yet; use parallel.fsdp=false (the "
                          "distributed optimizer)")
    check_language_run(cfg.language_run(), world_size, model_key="model.language")
    check_vlm_model(cfg.model, tp=p.tp)
    if p.virtual_pp > 1:
        raise ConfigError("parallel.virtual_pp > 1 is not supported for the VLM; use plain pipeline stages")
    if d.prefixes:
        raise ConfigError("data.prefixes is for GPT runs; a VLM run reads data.blend (a blend spec mixing indexed "
                          "text and type: energon entries, a metadataset YAML or a media folder) or data.mock=true")
    if not d.mock and not media.tokenizer:
        raise ConfigError("media.tokenizer is empty; the captions are tokenized on the fly with it (the "
                          "tokenizer the text shards were prepared with)")
    if cfg.model.tokens_per_image >= d.seq_length:
        raise ConfigError(f"the model's {cfg.model.tokens_per_image} placeholder tokens per image (from "
                          f"model.vision.image_size, patch_size and model.projector.pixel_shuffle) leave no room "
                          f"for text in data.seq_length ({d.seq_length})")
    a = cfg.model.audio
    longest = int(media.max_audio_seconds * a.sample_rate)  # samples of the longest clip the media path keeps
    frames = (longest // a.hop_length + 1) // 2  # spectrogram frames (Whisper's count), halved by the stride-2 stem
    if a.enabled and frames > a.max_frames:
        raise ConfigError(f"media.max_audio_seconds ({media.max_audio_seconds}) gives clips of {frames} encoder "
                          f"positions, more than model.audio.max_frames ({a.max_frames}); lower "
                          "media.max_audio_seconds or raise model.audio.max_frames")
    if world_size is not None and not d.mock:
        from mmtrain.parallel.dims import ParallelDims  # layout checks live with the layout

        dp = ParallelDims.from_config(p, world_size).dp
        if media.slices % dp:  # a dp rank reads slices / dp of the media slices
            raise ConfigError(f"media.slices ({media.slices}) must be a multiple of the data-parallel size ({dp}); "
                              "use a multiple of every data-parallel size the run may resume at")
    for i, prefix in enumerate(cfg.freeze):
        _check_prefix(prefix, f"freeze[{i}]")
    built = {"vision", "projector", "language"} | ({"audio"} if cfg.model.audio.enabled else set())
    if built <= set(cfg.freeze):
        raise ConfigError(f"freeze={cfg.freeze} freezes every component; nothing would train")
    sources = cfg.init.sources()
    if sources and cfg.init_from:
        raise ConfigError(f"init_from={cfg.init_from} and init.{next(iter(sources))} are both set: init_from starts "
                          "from a whole model, init.* from parts; use one")
    if "audio" in sources and not cfg.model.audio.enabled:
        raise ConfigError(f"init.audio={sources['audio']} but model.audio.enabled is false")
    for part, path in sources.items():
        if not Path(path).is_dir():
            raise ConfigError(f"init.{part}={path}: no such folder (a converted checkpoint or a Hugging Face model "
                              "folder)")
    for i, prefix in enumerate(cfg.init.expect_missing):
        _check_prefix(prefix, f"init.expect_missing[{i}]")
    for prefix in cfg.lr_scale:
        _check_prefix(prefix, f"lr_scale.{prefix}")
        if any(prefix == f or prefix.startswith(f + ".") for f in cfg.freeze):
            raise ConfigError(f"lr_scale.{prefix} names a frozen component (freeze={cfg.freeze}); remove one of them")


def _check_prefix(prefix: str, key: str) -> None:
    head = prefix.split(".", 1)[0]
    if head not in COMPONENTS:
        raise ConfigError(f"{key}: {prefix!r} is not a VLM component; prefixes start with one of "
                          f"{', '.join(COMPONENTS)} (e.g. vision, language.layers.0)")
