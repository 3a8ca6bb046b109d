"""One JSON Lines record as text: readable non-ASCII, but nothing any line splitter takes for a line end."""

from __future__ import annotations

import json

# json.dumps(ensure_ascii=False) escapes the C0 controls but leaves NEL, LINE SEPARATOR and PARAGRAPH
# SEPARATOR as they are; str.splitlines() (and many editors) break lines there, which would cut a record.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def jsonl_line(obj) -> str:
    """``obj`` as one line of JSON, newline included. A lone surrogate (a file name that is not UTF-8, a
    "\\ud800" escape) cannot be written as UTF-8: it is kept as its JSON escape, which reads back the same."""
    text = json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS)
    return text.encode("utf-8", "backslashreplace").decode("utf-8") + "\n"
