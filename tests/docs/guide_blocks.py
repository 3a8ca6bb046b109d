"""The fenced blocks of a Markdown page that a docs test runs, in page order.

A ```shell / ```bash / ```sh block is a command to run; an HTML comment on the line before a block says otherwise:
``<!-- guide-test: skip (why) -->`` (not run: an install, a GPU or multi-node command),
``<!-- guide-test: file NAME -->`` (the block is the content of the file NAME, written before the next command) or
``<!-- guide-test: insert NAME after TEXT -->`` (the block's lines go into the existing file NAME after the one
line holding TEXT: an edit of a file the reader already has).
Other blocks (```yaml without a file marker, ```python, plain) are text to read only."""

from __future__ import annotations

import re
from dataclasses import dataclass

_FENCE = re.compile(r"(?:^<!--\s*guide-test:\s*(?P<marker>[^>]*?)\s*-->\n)?^```(?P<lang>[\w-]*)\n(?P<body>.*?)^```",
                    re.M | re.S)
SHELL = {"shell", "bash", "sh"}


@dataclass(frozen=True)
class Block:
    kind: str  # "run", "file", "skip" or "text"
    body: str
    file: str = ""  # for "file" and "insert"
    after: str = ""  # for "insert": the text of the line the block goes after
    line: int = 0  # where the block starts in the page (1-based), for messages


def page_blocks(text: str) -> list[Block]:
    blocks = []
    for m in _FENCE.finditer(text):
        marker, lang, body = (m.group("marker") or "").strip(), m.group("lang"), m.group("body")
        line = text.count("\n", 0, m.start("lang")) + 1
        if marker.startswith("skip"):
            blocks.append(Block("skip", body, line=line))
        elif marker.startswith("file "):
            blocks.append(Block("file", body, file=marker.split(None, 1)[1].strip(), line=line))
        elif marker.startswith("insert ") and " after " in marker:
            name, after = marker.split(None, 1)[1].split(" after ", 1)
            blocks.append(Block("insert", body, file=name.strip(), after=after.strip(), line=line))
        elif marker:
            raise ValueError(f"line {line}: unknown guide-test marker {marker!r} (skip, file NAME or insert NAME "
                             "after TEXT)")
        else:
            blocks.append(Block("run" if lang in SHELL else "text", body, line=line))
    return blocks
