"""Do the files a run's data section names exist? Checked by the entry points before any process group is made
and before the run folder is created, so a wrong path is one line naming the key and the path tried, and the
run leaves nothing behind. No torch; the datasets themselves are opened (and checked further) when built."""

from __future__ import annotations

from pathlib import Path

import yaml

from mmtrain.core.indexed import bin_path, idx_path
from mmtrain.data.blend_spec import BlendSpecError, blend_from_prefixes, load_blend_spec
from mmtrain.data.prepared_names import loss_mask_prefix, preference_datasets


def _missing(key: str, value: str, what: str) -> BlendSpecError:
    return BlendSpecError(f"{key}={value}: {what} not found (looked for {Path(value).resolve()}); paths are "
                          "relative to the folder the run starts in")


def _missing_files(names: list[str]) -> list[str]:
    return [str(p.resolve()) for name in names for p in (idx_path(name), bin_path(name)) if not p.is_file()]


def _check_preference_prefix(prefixes: list[str]) -> None:
    """The one prefix of data.type=preference: the chosen / rejected tokens and masks `--preference` writes."""
    if len(prefixes) != 1:
        raise BlendSpecError(f"data.prefixes: data.type=preference reads one prepared prefix (the --output-prefix of "
                             f"mmtrain-prep sft --preference), got {len(prefixes)}")
    prefix = prefixes[0]
    missing = _missing_files(preference_datasets(prefix))
    if missing:
        hint = (f"; {prefix}.bin is there: was it prepared without --preference?" if bin_path(prefix).is_file()
                else "")
        raise BlendSpecError(f"data.prefixes[0]={prefix}: preference pairs not found (missing {', '.join(missing)})"
                             f"{hint}; give the --output-prefix of mmtrain-prep sft --preference (it writes "
                             f"{prefix}_chosen* and {prefix}_rejected*), relative to the folder the run starts in")


def check_gpt_data_paths(cfg) -> None:
    """``data.blend`` (a blend spec file) or ``data.prefixes`` exist: each PREFIX.bin and PREFIX.idx, with
    ``data.type=sft`` also PREFIX_loss_mask, with ``data.type=preference`` the chosen / rejected datasets and
    their masks."""
    d = cfg.data
    if d.mock or cfg.train.objective == "grpo":  # GRPO reads grpo.prompts (its validation checks the file is there)
        return
    if d.blend:
        if not Path(d.blend).is_file():
            raise _missing("data.blend", d.blend, "blend spec")
        load_blend_spec(d.blend)  # every entry's files, relative to the spec
    elif d.type == "preference":
        _check_preference_prefix(list(d.prefixes))
    else:
        spec = blend_from_prefixes(d.prefixes, d.weights)  # each prefix's .bin and .idx, relative to the working folder
        for e in spec.datasets if d.type == "sft" else ():
            missing = _missing_files([loss_mask_prefix(e.path)])
            if missing:
                raise BlendSpecError(f"{e.where}: {e.path} has no loss mask (missing {', '.join(missing)}); "
                                     "data.type=sft reads the output of mmtrain-prep sft, which writes "
                                     "PREFIX_loss_mask beside PREFIX")


def check_vlm_data_paths(cfg) -> None:
    """``data.blend`` of a VLM run: a media shard folder (with energon's ``.nv-meta/``), an energon metadataset
    YAML, or a blend spec whose text prefixes and media folders exist; and ``media.tokenizer``."""
    d = cfg.data
    if d.mock:
        return
    path = Path(d.blend)
    if path.is_dir():
        if not (path / ".nv-meta").is_dir():
            raise BlendSpecError(f"data.blend={d.blend}: {path.resolve()} has no .nv-meta/ folder; give the output "
                                 "folder of mmtrain-prep media, an energon metadataset YAML or a blend spec")
    elif not path.is_file():
        raise _missing("data.blend", d.blend, "media folder or blend spec")
    elif not _is_metadataset(path):  # energon checks its own metadatasets
        spec = load_blend_spec(path)
        entries = spec.datasets if spec.per_split is None else [e for es in spec.per_split.values() for e in es]
        for e in entries:
            if e.type == "energon" and not (Path(e.path) / ".nv-meta").is_dir():
                raise BlendSpecError(f"{e.where}: {e.path} has no .nv-meta/ folder; give the output folder of "
                                     "mmtrain-prep media")
    if cfg.media.tokenizer and not Path(cfg.media.tokenizer).exists():
        raise _missing("media.tokenizer", cfg.media.tokenizer, "tokenizer file")


def _is_metadataset(path: Path) -> bool:
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise BlendSpecError(f"data.blend={path}: unreadable ({exc})") from None
    return isinstance(raw, dict) and "__class__" in raw
