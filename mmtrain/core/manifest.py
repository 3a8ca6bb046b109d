"""The manifest ``mmtrain-prep text`` writes next to an indexed prefix (``PREFIX.manifest.json``): which
tokenizer made the tokens, their end-of-document id. Read by the data loaders (blend checks) and by the HF export
(the tokenizer a checkpoint's data was prepared with)."""

from __future__ import annotations

import json
from pathlib import Path


class ManifestError(ValueError):
    """A manifest that cannot be read; the message names the file."""


def read_prefix_manifest(prefix: str) -> dict | None:
    """The manifest ``mmtrain-prep`` wrote for PREFIX (at PREFIX, or at P for a multi-key output P_<key>); None
    when there is none."""
    own = Path(f"{prefix}.manifest.json")
    candidates = [own]
    name = Path(prefix).name
    if "_" in name:
        candidates.append(Path(prefix).with_name(name[:name.rfind("_")] + ".manifest.json"))
    for c in candidates:
        if c.is_file():
            try:
                value = json.loads(c.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ManifestError(f"{c}: unreadable manifest ({exc}); re-run mmtrain-prep") from None
            return value if isinstance(value, dict) else {}
    return None
