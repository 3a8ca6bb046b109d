"""Precomputed DPO reference log-probabilities, stored beside the preference shards (``dpo.reference_logps:
precomputed``; written by ``python -m mmtrain.dpo_reference``).

``PREFIX.dpo_reference.bin``: float64 (pairs, 2) little-endian -- per pair (document ``i`` of ``PREFIX_chosen`` /
``PREFIX_rejected``) the reference model's sequence log-probabilities of the chosen and the rejected answer,
summed over the answer's loss tokens of the first ``seq_length + 1`` tokens (what the DPO step sees).
``PREFIX.dpo_reference.json`` (written last: the pair is complete when it exists) records the checksum (XXH3)
and size of the ``.bin``, the pair count, ``seq_length`` and the reference checkpoint. A reader checks them all
against the run; any mismatch is a one-line error naming the file and what to do.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmtrain.data.blend_spec import BlendSpecError
from mmtrain.utils.atomic import atomic_write_bytes, atomic_write_text
from mmtrain.utils.file_checksums import entry_of_bytes, file_problem

FORMAT = "mmtrain-dpo-reference-1"


def reference_logps_paths(prefix: str | Path) -> tuple[Path, Path]:
    """(values file, record file) beside the preference prefix."""
    return Path(f"{prefix}.dpo_reference.bin"), Path(f"{prefix}.dpo_reference.json")


def write_reference_logps(prefix: str | Path, values: np.ndarray, seq_length: int, reference: str) -> Path:
    """Write ``values`` (pairs, 2) atomically, the record last (a complete earlier pair stays until then)."""
    values = np.ascontiguousarray(values, dtype="<f8")
    if values.ndim != 2 or values.shape[1] != 2 or not np.isfinite(values).all():
        raise ValueError(f"reference log-probs must be finite (pairs, 2), got shape {values.shape}")
    data, record = reference_logps_paths(prefix)
    payload = values.tobytes()
    atomic_write_bytes(data, payload)
    atomic_write_text(record, json.dumps({"format": FORMAT, "pairs": int(values.shape[0]),
                                          "seq_length": int(seq_length), "reference": reference,
                                          "file": data.name, "checksum": entry_of_bytes(payload)},
                                         indent=2, sort_keys=True) + "\n")
    return record


def read_reference_logps(prefix: str | Path, pairs: int, seq_length: int) -> np.ndarray:
    """The (pairs, 2) float64 values, after checking the record, the checksum and that they fit this run."""
    data, record_path = reference_logps_paths(prefix)
    fix = "run python -m mmtrain.dpo_reference with this run's config to (re)compute them"
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BlendSpecError(f"dpo.reference_logps=precomputed: {record_path} is missing; {fix}") from None
    except (OSError, ValueError) as exc:
        raise BlendSpecError(f"dpo.reference_logps=precomputed: {record_path}: {exc}; {fix}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("checksum"), dict):
        raise BlendSpecError(f"dpo.reference_logps=precomputed: {record_path} is not a {FORMAT} record; {fix}")
    if record.get("pairs") != pairs:
        raise BlendSpecError(f"dpo.reference_logps=precomputed: {record_path} holds {record.get('pairs')} pairs, "
                             f"{prefix} has {pairs} (the data was re-prepared?); {fix}")
    if record.get("seq_length") != seq_length:
        raise BlendSpecError(f"dpo.reference_logps=precomputed: {record_path} was computed for data.seq_length="
                             f"{record.get('seq_length')}, this run has {seq_length} (answers are cut there); {fix}")
    problem = file_problem(data, record["checksum"])
    if problem:
        raise BlendSpecError(f"dpo.reference_logps=precomputed: {data} {problem}; {fix}")
    values = np.frombuffer(data.read_bytes(), dtype="<f8").reshape(pairs, 2).copy()  # writable: torch takes it
    if not np.isfinite(values).all():
        raise BlendSpecError(f"dpo.reference_logps=precomputed: {data} holds non-finite values; {fix}")
    return values
