"""Cross-field checks of a VLM run config, before any process group is made; each names the key to fix."""

from __future__ import annotations

import re

from mmtrain.config.loader import ConfigError
from mmtrain.config.ranges import check_ranges
from mmtrain.config.schema import GPTRunConfig
from mmtrain.config.validate import validate_gpt_config
from mmtrain.config.vlm_run_schema import COMPONENTS, VLMRunConfig
from mmtrain.config.vlm_schema import check_vlm_model


def validate_vlm_config(cfg: VLMRunConfig, world_size: int | None = None) -> None:
    """Raise ``ConfigError`` on impossible combinations (the GPT run's checks with the language model as
    ``model.language``, the VLM shape against the data's placeholder settings, the layout the VLM supports,
    ``freeze`` and ``lr_scale``)."""
    p, d = cfg.parallel, cfg.data
    check_ranges(cfg)  # every numeric field, the VLM model's included, named by its own key
    gpt = GPTRunConfig(model=cfg.model.language, parallel=p, data=d, optim=cfg.optim, train=cfg.train,
                       logging=cfg.logging, checkpoint=cfg.checkpoint)
    try:
        validate_gpt_config(gpt, world_size)
    except ConfigError as exc:  # the language model's keys live under model.language in a VLM config
        raise ConfigError(re.sub(r"\bmodel\.", "model.language.", str(exc))) from None
    check_vlm_model(cfg.model, d, tp=p.tp)
    if p.virtual_pp > 1:
        raise ConfigError("parallel.virtual_pp > 1 is not supported for the VLM; use plain pipeline stages")
    if d.prefixes:
        raise ConfigError("data.prefixes is for GPT runs; a VLM run reads data.blend (a blend spec mixing indexed "
                          "text and type: energon entries, a metadataset YAML or a media folder) or data.mock=true")
    if not d.mock and not d.mm_tokenizer:
        raise ConfigError("data.mm_tokenizer is empty; the captions are tokenized on the fly with it (the "
                          "tokenizer the text shards were prepared with)")
    if d.mm_num_image_tokens >= d.seq_length:
        raise ConfigError(f"data.mm_num_image_tokens ({d.mm_num_image_tokens}) leaves no room for text in "
                          f"data.seq_length ({d.seq_length})")
    for i, prefix in enumerate(cfg.freeze):
        _check_prefix(prefix, f"freeze[{i}]")
    built = {"vision", "projector", "language"} | ({"audio"} if cfg.model.audio.enabled else set())
    if built <= set(cfg.freeze):
        raise ConfigError(f"freeze={cfg.freeze} freezes every component; nothing would train")
    for prefix in cfg.lr_scale:
        _check_prefix(prefix, f"lr_scale.{prefix}")
        if any(prefix == f or prefix.startswith(f + ".") for f in cfg.freeze):
            raise ConfigError(f"lr_scale.{prefix} names a frozen component (freeze={cfg.freeze}); remove one of them")


def _check_prefix(prefix: str, key: str) -> None:
    head = prefix.split(".", 1)[0]
    if head not in COMPONENTS:
        raise ConfigError(f"{key}: {prefix!r} is not a VLM component; prefixes start with one of "
                          f"{', '.join(COMPONENTS)} (e.g. vision, language.layers.0)")
