"""The data of a VLM run from its config: ``data.blend`` (a blend spec mixing indexed text and ``type: energon``
media entries, a metadataset YAML or one media folder) or ``data.mock`` -> ``VLMBatches`` for this rank.

A mixed spec is cut in two derived specs written next to the run (``run_dir/data/``): the text entries feed the
GPT sample machinery (same indices and checks as a GPT run), the energon entries the multimodal loader. The
share of text rows is the text entries' weight over all weights, so a mixed spec must weigh every entry.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from mmtrain.data.blend import build_gpt_samples_from_config
from mmtrain.data.blend_spec import BlendSpecError, load_blend_spec
from mmtrain.data.gpt_dataset import packed_document_inputs
from mmtrain.data.vlm_batches import EnergonRows, MockMediaSamples, VLMBatches
from mmtrain.utils.atomic import atomic_write_text
from mmtrain.utils.log import get_logger

log = get_logger("mmtrain.data")


def _entry(e) -> dict:
    out = {"path": e.path, "type": e.type}
    if e.weight is not None:
        out["weight"] = e.weight
    return out


def _write_spec(spec, keep, path: Path) -> Path:
    if spec.per_split is not None:
        body = {split: [_entry(e) for e in es if keep(e)] for split, es in spec.per_split.items()}
        body = {k: v for k, v in body.items() if v}
    else:
        body = {"datasets": [_entry(e) for e in spec.datasets if keep(e)]}
        if spec.split is not None and keep.__name__ == "_is_text":
            body["split"] = spec.split
    atomic_write_text(path, yaml.safe_dump(body, sort_keys=False))
    return path


def _is_text(e) -> bool:
    return e.type != "energon"


def _is_media(e) -> bool:
    return e.type == "energon"


def describe_blend(split: str, entries, fraction: float) -> str:
    """One log line naming every dataset of a VLM blend, text and media, with its share of the rows."""
    total = sum(e.weight for e in entries if e.weight is not None)
    text, media = [e for e in entries if _is_text(e)], [e for e in entries if _is_media(e)]

    def named(es) -> str:
        return ", ".join(Path(e.path).name + (f" {e.weight / total:.4f}" if e.weight is not None and total else "")
                         for e in es)
    parts = ([f"text {fraction:.4f} of rows ({named(text)})"] if text else []) + \
            ([f"media {1 - fraction:.4f} of rows ({named(media)})"] if media else [])
    return (f"{split} VLM blend: {len(entries)} dataset(s): " + "; ".join(parts)
            + ("; the text part's own blend follows" if text else ""))


def _split_blend(blend: str, run_dir: str, split: str) -> tuple[Path | None, Path | str | None, float]:
    """(text-only spec or None, media source or None, text fraction of ``split``) for ``data.blend``."""
    path = Path(blend)
    if path.is_dir() or not path.is_file():
        log.info("%s VLM data: media from %s (every row)", split, blend)
        return None, blend, 0.0  # a media folder (or a missing path: the multimodal loader names it)
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    if isinstance(raw, dict) and "__class__" in raw:
        log.info("%s VLM data: media from the energon metadataset %s (every row)", split, blend)
        return None, blend, 0.0  # an energon metadataset
    spec = load_blend_spec(path)
    entries = spec.entries_for(split)
    if not entries:
        raise BlendSpecError(f"{path}: no datasets for split {split!r}")
    text, media = [e for e in entries if _is_text(e)], [e for e in entries if _is_media(e)]
    if text and media and any(e.weight is None for e in entries):
        missing = next(e for e in entries if e.weight is None)
        raise BlendSpecError(f"{missing.where}: a blend mixing text and energon entries must weigh every entry "
                             "(energon sets have no token counts to weigh by); add weight: to each")
    fraction = 1.0 if not media else 0.0 if not text else sum(e.weight for e in text) / sum(e.weight for e in entries)
    log.info(describe_blend(split, entries, fraction))  # the text blend's own lines follow (blend.py)
    out = Path(run_dir) / "data"
    stem = path.stem
    text_spec = _write_spec(spec, _is_text, out / f"{stem}.text.yaml") if text else None
    media_spec = _write_spec(spec, _is_media, out / f"{stem}.media.yaml") if media else None
    return text_spec, media_spec, fraction


def _text_samples(cfg, text_spec: Path, split: str, dp: int, index_builder: bool):
    """The text entries' samples: the language model's run (``VLMRunConfig.language_run``) on the text spec."""
    run = dataclasses.replace(cfg.language_run(), data=dataclasses.replace(cfg.data, blend=str(text_spec),
                                                                           prefixes=[], weights=[]))
    return build_gpt_samples_from_config(run, split, dp, index_builder=index_builder)


def _text_row_inputs(d, eod_id):
    """Per-row positions, document ids and loss mask of packed text rows (``data``'s reset/eod keys), or None."""
    if not (d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss):
        return None

    def inputs(tokens):
        positions, doc_ids, loss_mask = packed_document_inputs(tokens, eod_id, d.reset_position_ids,
                                                               d.reset_attention_mask, d.eod_mask_loss)
        return positions, doc_ids, loss_mask if d.eod_mask_loss else None
    return inputs


def build_vlm_batches(cfg, mesh, split: str = "train", pin: bool = False) -> VLMBatches:
    """This rank's VLM micro-batches for ``split`` (``train`` or ``valid``) of a ``VLMRunConfig``; ``pin``: in
    pinned host memory (a CUDA run)."""
    d, m, dp, dp_rank = cfg.data, cfg.model, mesh.dims.dp, mesh.coord.dp
    image_size, vocab = m.vision.image_size, m.language.vocab_size
    if d.mock:
        audio_id = m.audio_token_id if m.audio.enabled else -1
        media = MockMediaSamples(vocab, d.seq_length, m.image_token_id, m.tokens_per_image, image_size,
                                 d.seed + {"train": 0, "valid": 1}[split],
                                 text_ids_below=min(i for i in (m.image_token_id, audio_id, vocab) if i > 1))
        return VLMBatches(media, None, 0.0, cfg.train.micro_batch_size, dp_rank, dp, image_size, pin=pin)
    text_spec, media_src, fraction = _split_blend(d.blend, cfg.logging.run_dir, split)
    text = row_inputs = None
    if text_spec is not None:
        text = _text_samples(cfg, text_spec, split, dp, mesh.node_local_rank == 0)
        row_inputs = _text_row_inputs(d, getattr(text, "eod_id", None))
    media = None
    if media_src is not None:
        from mmtrain.data.multimodal_loader import build_multimodal_loader  # needs megatron-energon

        loader = build_multimodal_loader(dataclasses.replace(d, blend=str(media_src)), cfg.media, m,
                                         micro_batch_size=1, mesh=mesh, split=split)
        media = EnergonRows(loader)
    return VLMBatches(media, text, fraction, cfg.train.micro_batch_size, dp_rank, dp, image_size, row_inputs,
                      pin=pin)
