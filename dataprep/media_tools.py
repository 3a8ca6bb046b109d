"""`mmtrain-prep inspect DIR` and `mmtrain-prep verify DIR` for a media shard folder (see `dataprep.media`)."""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import tarfile
from pathlib import Path

import yaml

from dataprep.errors import PrepError
from dataprep.media import MANIFEST_FORMAT, STATE_FILE
from dataprep.media_chat import IMAGE_SLOT
from dataprep.media_shards import NV_META, SPLITS, scan_shard
from mmtrain.core.tokenizer import load_tokenizer


def _load_manifest(folder: Path) -> dict:
    path = folder / "manifest.json"
    if not path.exists():
        if (folder / STATE_FILE).exists():
            raise PrepError(f"{folder}: an interrupted `mmtrain-prep media` run; finish it with --resume")
        raise PrepError(f"{folder}: no manifest.json; not a folder written by `mmtrain-prep media`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise PrepError(f"{path}: unreadable ({exc})") from None
    if manifest.get("format") != MANIFEST_FORMAT:
        raise PrepError(f"{path}: format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    return manifest


def _first_samples(folder: Path, shards: list[dict], n: int) -> list[dict]:
    """The ``json`` metadata of the first ``n`` samples, read straight from the tars."""
    out: list[dict] = []
    for rec in shards:
        if len(out) >= n:
            break
        with tarfile.open(folder / rec["name"], "r:") as tar:
            for m in tar:
                if m.isreg() and m.name.endswith(".json"):
                    meta = json.loads(tar.extractfile(m).read())
                    meta["key"] = m.name.split(".", 1)[0]
                    meta["shard"] = rec["name"]
                    out.append(meta)
                    if len(out) >= n:
                        break
    return out


def _describe(meta: dict) -> str:
    text = meta.get("caption") or meta.get("text")
    turns = meta.get("conversation") or meta.get("messages")
    if text is None and turns:
        text = " | ".join(f"{t['role']}: {t['content']}" for t in turns)
    text = (text or "")[:80]
    info = ""
    if "images" in meta:
        info = ", ".join(f"{i['width']}x{i['height']} {i['format']}" for i in meta["images"])
    elif "audio" in meta:
        a = meta["audio"]
        info = f"{a['duration']:.2f}s {a['sample_rate']} Hz {a['channels']} ch {a['format']}"
    elif "video" in meta:
        v = meta["video"]
        info = f"{v['frames']} frames @ {v['fps'] or 0:.2f} fps, {v.get('duration') or 0:.2f}s {v['format']}"
    return f"{meta['key']} [{meta['modality']}; {info}] ({meta['shard']}) {text!r}"


def _chat_runs(tokenizer, chat: dict) -> list[str]:
    """A chat sample's tokens as lines, one per run: ``LOSS 'text'`` (carries the loss), ``---- 'text'`` (does
    not) and ``IMAGE xN`` (N image slots in a row; the loader expands each to the model's placeholders)."""
    lines, run, kind = [], [], None

    def flush():
        if run:
            lines.append(f"IMAGE x{len(run)}" if kind == "IMAGE" else f"{kind} {tokenizer.decode(run)[:2000]!r}")

    for token, loss in zip(chat["tokens"], chat["loss_mask"]):
        k = "IMAGE" if token == IMAGE_SLOT else "LOSS" if loss else "----"
        if k != kind:
            flush()
            run, kind = [], k
        run.append(token)
    flush()
    return lines


def _chat_tokenizer(args: argparse.Namespace, manifest: dict, samples: list[dict]):
    """The tokenizer to decode chat samples with: --tokenizer, else the one the manifest records; None when no
    sample shown is a chat sample."""
    if not any("chat" in m for m in samples):
        return None
    source = args.tokenizer or (((manifest.get("options") or {}).get("chat") or {}).get("tokenizer") or {}).get("path")
    if not source:
        raise PrepError(f"{args.target}: chat samples, but no tokenizer recorded in manifest.json; pass --tokenizer")
    return load_tokenizer(source)


def inspect_media(args: argparse.Namespace) -> int:
    folder = Path(args.target)
    manifest = _load_manifest(folder)
    shards = manifest["shards"]
    sizes = [s["bytes"] for s in shards]
    counts = manifest["counts"]
    samples = _first_samples(folder, shards, max(args.samples, 0))
    if args.json:
        print(json.dumps({"counts": counts, "sample_type": manifest["sample_type"], "shards": shards,
                          "samples": samples}, indent=1, ensure_ascii=False))
        return 0
    print(f"{folder}: {counts['written']} samples ({', '.join(f'{k} {v}' for k, v in counts['modalities'].items())}); "
          f"train {counts['splits']['train']}, val {counts['splits']['val']}; energon sample type "
          f"{manifest['sample_type']}")
    print(f"  rows read {counts['rows_read']}, rejected {counts['rejected']}"
          + (f" ({', '.join(f'{k} {v}' for k, v in counts['rejects_by_code'].items())}; see rejects.jsonl)"
             if counts["rejected"] else ""))
    print(f"  {len(shards)} shards, {sum(sizes) / 1e6:.2f} MB; shard size min {min(sizes) / 1e6:.2f} / "
          f"mean {sum(sizes) / len(sizes) / 1e6:.2f} / max {max(sizes) / 1e6:.2f} MB")
    for rec in shards[:10]:
        print(f"    {rec['name']:28s} {rec['split']:5s} {rec['samples']:7d} samples {rec['bytes'] / 1e6:9.2f} MB")
    if len(shards) > 10:
        print(f"    ... {len(shards) - 10} more")
    tokenizer = _chat_tokenizer(args, manifest, samples)
    for meta in samples:
        print("  " + _describe(meta))
        if "chat" in meta:
            chat = meta["chat"]
            print(f"    {len(chat['tokens'])} tokens, {sum(chat['loss_mask'])} carry the loss (LOSS lines):")
            for line in _chat_runs(tokenizer, chat):
                print("    " + line)
    return 0


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def verify_media(args: argparse.Namespace) -> int:
    folder = Path(args.target)
    manifest = _load_manifest(folder)
    problems: list[str] = []
    shards = manifest["shards"]
    keys: dict[str, str] = {}
    total = 0
    for rec in shards:
        path = folder / rec["name"]
        if not path.is_file():
            problems.append(f"{path}: missing")
            continue
        if path.stat().st_size != rec["bytes"]:
            problems.append(f"{path}: {path.stat().st_size} bytes, manifest says {rec['bytes']}")
            continue
        if not args.no_checksums and _sha256(path) != rec["sha256"]:
            problems.append(f"{path}: sha256 differs from the manifest (the shard changed or is corrupt)")
            continue
        try:
            samples, end = scan_shard(path)
        except (tarfile.TarError, OSError) as exc:
            problems.append(f"{path}: not a readable tar: {exc}")
            continue
        if len(samples) != rec["samples"]:
            problems.append(f"{path}: {len(samples)} samples, manifest says {rec['samples']}")
        total += len(samples)
        for s in samples:
            if s.key in keys:
                problems.append(f"{path}: sample key {s.key!r} also in {keys[s.key]}")
            keys[s.key] = rec["name"]
        idx = path.with_suffix(".tar.idx")
        want = struct.pack(f"<{len(samples) + 1}Q", *([s.offset for s in samples] + [end]))
        if not idx.is_file() or idx.read_bytes() != want:
            problems.append(f"{idx}: missing or does not match the shard (rerun the prep with --overwrite)")
    if total != manifest["counts"]["written"] and not problems:
        problems.append(f"{folder}: shards hold {total} samples, manifest says {manifest['counts']['written']}")
    meta = folder / NV_META
    try:
        info = json.loads((meta / ".info.json").read_text())
        want_counts = {r["name"]: r["samples"] for r in shards}
        if info.get("shard_counts") != want_counts:
            problems.append(f"{meta / '.info.json'}: shard counts differ from manifest.json")
        split = yaml.safe_load((meta / "split.yaml").read_text())
        for s in SPLITS:
            listed = split["split_parts"].get(s) or []
            want = [r["name"] for r in shards if r["split"] == s]
            if listed != want:
                problems.append(f"{meta / 'split.yaml'}: split {s!r} lists {len(listed)} shards, manifest {len(want)}")
        for name in ("dataset.yaml", "index.sqlite", "index.uuid"):
            if not (meta / name).is_file():
                problems.append(f"{meta / name}: missing")
    except (OSError, ValueError, KeyError, TypeError, yaml.YAMLError) as exc:
        problems.append(f"{meta}: unreadable energon metadata: {exc}")
    listed_names = {r["name"] for r in shards}
    for p in sorted(folder.glob("shard-*.tar")):
        if p.name not in listed_names:
            problems.append(f"{p}: shard not listed in manifest.json")
    rejects = folder / "rejects.jsonl"
    n_rejects = sum(1 for line in rejects.open(encoding="utf-8") if line.strip()) if rejects.exists() else None
    if n_rejects != manifest["counts"]["rejected"]:
        problems.append(f"{rejects}: {n_rejects} lines, manifest says {manifest['counts']['rejected']} rejected")
    c = manifest["counts"]
    if c["rows_read"] != c["written"] + c["rejected"]:
        problems.append(f"{folder / 'manifest.json'}: rows read {c['rows_read']} != written + rejected")
    if args.json:
        print(json.dumps({"ok": not problems, "problems": problems, "shards": len(shards), "samples": total}))
    else:
        for p in problems:
            print(p)
        print(f"{folder}: {'OK' if not problems else f'{len(problems)} problem(s)'}: {len(shards)} shards, "
              f"{total} samples" + ("" if not args.no_checksums else " (checksums skipped)"))
    return 0 if not problems else 1
