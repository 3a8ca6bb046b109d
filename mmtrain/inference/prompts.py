"""Prompts in and completions out for the command line: the prompts file (JSONL) and the completions rows."""

from __future__ import annotations

import json
from pathlib import Path


class PromptError(ValueError):
    """A prompt the model cannot take (e.g. token ids beyond its vocabulary); the message says which."""


class PromptsFileError(PromptError):
    """A prompts file that cannot be read; the message names the file and line."""


def read_prompts_file(path: str | Path) -> list[str]:
    """The ``prompt`` strings of a JSONL file (one object per line, ``{"prompt": "..."}``; blank lines skipped)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise PromptsFileError(f"{path}: cannot read the prompts file ({exc.strerror or exc})") from None
    prompts = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            raise PromptsFileError(f"{path}:{n}: not UTF-8 text") from None
        except ValueError as exc:
            raise PromptsFileError(f"{path}:{n}: not a JSON object ({exc.msg}); each line is "
                                   '{"prompt": "..."}') from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise PromptsFileError(f'{path}:{n}: needs a string field "prompt"; each line is {{"prompt": "..."}}')
        prompts.append(row["prompt"])
    if not prompts:
        raise PromptsFileError(f"{path}: no prompts (one JSON object per line: {{\"prompt\": \"...\"}})")
    return prompts


def completion_row(prompt: str, seq) -> dict:
    """One completions row (the ``--output`` JSONL); a prompt that failed has ``error`` too."""
    row = {"prompt": prompt, "completion": seq.text, "tokens": len(seq.token_ids),
           "finish_reason": seq.finish_reason, "token_ids": seq.token_ids}
    if seq.error is not None:
        row["error"] = seq.error
    return row
