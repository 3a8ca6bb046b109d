"""One JSON Lines record as text: readable non-ASCII, but nothing any line splitter takes for a line end."""

from __future__ import annotations

import json

# json.dumps(ensure_ascii=False) escapes the C0 controls but leaves NEL, LINE SEPARATOR and PARAGRAPH
# SEPARATOR as they are; str.splitlines() (and many editors) break lines there, which would cut a record.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def jsonl_line(obj) -> str:
    """``obj`` as one line of JSON, newline included."""
    return json.dumps(obj, ensure_ascii=False).translate(_LINE_BREAKS) + "\n"
