"""Character spans of SentencePiece pieces, for a loss mask over character spans (``mmtrain-prep sft``).

SentencePiece reports where in its input each piece came from; this module turns that into the ``[start, end)``
character spans that Hugging Face ``tokenizers`` reports for the same ids (a transformers-converted copy of the
model, e.g. ``mmtrain-to-hf --tokenizer``), so a loss mask made from them is the same with either file:

- sentencepiece releases with ``out_type='offset_mapping'`` give character offsets directly; older ones only
  their protobuf result, whose byte offsets are converted here (a small reader of the protobuf wire format, so
  no protobuf package is needed);
- pieces that stand for no character of their own come back as empty spans: the dummy-prefix ``▁`` at the
  start, and every byte-fallback piece of a character but its last (``<0xE6> <0x9D> <0xB1>`` for 東 are
  ``[p, p) [p, p) [p, p + 1)``). Each empty span at ``p`` becomes ``[p, p + 1)``, the character it belongs to,
  as ``tokenizers`` reports it: every byte of a trained character carries the loss.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Sequence

Offsets = list[tuple[int, int]]


def piece_offsets(sp, texts: Sequence[str], threads: int = 1) -> list[tuple[list[int], Offsets]]:
    """``(ids, character spans)`` of each text, encoded by the ``SentencePieceProcessor`` ``sp``."""
    texts = list(texts)
    try:
        results = sp.encode(texts, out_type="offset_mapping", num_threads=threads)
    except (ValueError, TypeError):  # a release without offset_mapping: read the protobuf results
        protos = sp.encode(texts, out_type="serialized_proto", num_threads=threads)
        encoded = [_ids_and_byte_spans(p) for p in protos]
        return [(ids, _widen_empty(_char_spans(text, spans), len(text)))
                for text, (ids, spans) in zip(texts, encoded)]
    return [(list(r["ids"]), _widen_empty([tuple(o) for o in r["offsets"]], len(text)))
            for text, r in zip(texts, results)]


def _widen_empty(spans: Offsets, length: int) -> Offsets:
    return [(a, a + 1) if a == b and a < length else (a, b) for a, b in spans]


def _char_spans(text: str, byte_spans: Offsets) -> Offsets:
    """Byte offsets into ``text``'s UTF-8 -> character offsets (a byte inside a character maps to it)."""
    if text.isascii():
        return byte_spans
    starts, position = [], 0  # byte offset where each character starts
    for ch in text:
        starts.append(position)
        position += len(ch.encode("utf-8", "surrogatepass"))
    starts.append(position)

    def char_at(b: int, ceil: bool) -> int:
        i = bisect_right(starts, b) - 1
        return i + 1 if ceil and starts[i] != b else i

    return [(char_at(a, False), char_at(b, True)) for a, b in byte_spans]


def _ids_and_byte_spans(proto: bytes) -> tuple[list[int], Offsets]:
    """A serialized ``SentencePieceText``: its pieces' ids (field 2) and byte spans (fields 4, 5)."""
    ids, spans = [], []
    for field, value in _fields(proto):
        if field == 2:  # SentencePieceText.pieces
            piece_id = begin = end = 0
            for inner, v in _fields(value):
                if inner == 2:
                    piece_id = v
                elif inner == 4:
                    begin = v
                elif inner == 5:
                    end = v
            ids.append(piece_id)
            spans.append((begin, end))
    return ids, spans


def _fields(buf: bytes):
    """(field number, value) of one protobuf message: varints as int, length-delimited fields as bytes."""
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        wire = key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i:i + size], i + size
        elif wire == 5:
            value, i = buf[i:i + 4], i + 4
        elif wire == 1:
            value, i = buf[i:i + 8], i + 8
        else:
            raise ValueError(f"protobuf wire type {wire} in a SentencePiece result")
        yield key >> 3, value


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = buf[i]
        i += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, i
        shift += 7
