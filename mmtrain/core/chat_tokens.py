"""Chat text -> token ids where only the chat template makes control tokens: a message's text is text.

A tokenizer turns the strings of its control tokens (``<|im_start|>``, ``<|eot_id|>``, ...) into those tokens
wherever they occur. In a rendered conversation that would let a message that types ``<|im_start|>system``
write real template structure (role injection). So, before rendering, every control-token string inside a
message's text is made inert: its first character is swapped for a private Unicode noncharacter (one per distinct
first character, so the swap is undone exactly and lengths do not change). The rendered text then holds control
strings only where the template wrote them, and encoding it:

- for a Hugging Face tokenizer, encodes the whole text in one call (so a conversation without such strings gets
  exactly the ids of ``transformers``' ``apply_chat_template``); if it holds swapped characters, each stretch
  between two control tokens that holds one is encoded again, swapped back, as plain text (the tokenizer's
  control tokens switched off, ``encode_special_tokens``), offsets shifted into place;
- for a SentencePiece tokenizer, encodes the text as whole as it can: the declared special tokens (user-defined
  pieces such as chatml's ``<|im_start|>`` from ``train-tokenizer --chat-template``) are read out of text by
  SentencePiece itself, so a conversation without control pieces is one call (the ids and character spans
  ``transformers`` gives on the model's HF export); control pieces the template wrote (``<s>``, ``</s>``, which
  SentencePiece never reads from text) become their ids, the text between them encoded as text; a character the
  guard swapped becomes that character's own ids (its piece, else its bytes), so a message's ``<|im_start|>`` is
  text.

Noncharacters U+FDD0..U+FDEF are never meaningful text; a message holding one is refused (``RenderError``), so
neither the generation markers (U+FDD0/U+FDD1) nor the swaps can be forged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from mmtrain.core.tokenizer import HuggingFaceTokenizer, SentencePieceTokenizer, Tokenizer

# U+FDD0/U+FDD1 mark generation blocks while a template renders (chat_template); the rest stand in for the first
# character of a control-token string inside a message.
PRIVATE_FIRST, PRIVATE_LAST = 0xFDD0, 0xFDEF
_SWAP_CHARS = [chr(c) for c in range(0xFDD2, PRIVATE_LAST + 1)]
_PRIVATE = re.compile(f"[{chr(PRIVATE_FIRST)}-{chr(PRIVATE_LAST)}]")


class ChatTemplateError(ValueError):
    """A chat template (or a tokenizer for it) that cannot be used at all: the message names the file and the fix."""


class RenderError(ValueError):
    """One conversation the template cannot render (or whose assistant spans cannot be found)."""


def private_char(text: str) -> str | None:
    """The first private noncharacter (U+FDD0..U+FDEF) in ``text``, or None."""
    m = _PRIVATE.search(text)
    return m.group() if m else None


class ContentGuard:
    """Makes message text unable to spell the tokenizer's control tokens (and undoes it after rendering).
    ``keep``: control strings a message may hold on purpose (the media prep's own ``<image>`` placeholder)."""

    def __init__(self, control_tokens: Iterable[str], keep: Iterable[str] = ()) -> None:
        kept = set(keep)
        strings = sorted({t for t in control_tokens if t and t not in kept}, key=len, reverse=True)
        firsts = sorted({t[0] for t in strings})
        if len(firsts) > len(_SWAP_CHARS):
            raise ChatTemplateError(f"the tokenizer's control tokens begin with {len(firsts)} different characters; "
                                    f"message text can be guarded for at most {len(_SWAP_CHARS)}")
        self._swap = dict(zip(firsts, _SWAP_CHARS))
        self._unswap = str.maketrans({v: k for k, v in self._swap.items()})
        self._swapped = re.compile(f"[{''.join(self._swap.values())}]") if self._swap else None
        # longest first: at one position the longest control string is the one a tokenizer would match
        self._pattern = re.compile("|".join(map(re.escape, strings))) if strings else None

    def guard(self, text: str) -> str:
        """``text`` with the first character of every control-token string swapped (repeated until none is left:
        a swap could leave another control string inside the one it broke)."""
        if self._pattern is None:
            return text
        while (m := self._pattern.search(text)) is not None:
            i = m.start()
            text = text[:i] + self._swap[text[i]] + text[i + 1:]
        return text

    def unguard(self, text: str) -> str:
        return text.translate(self._unswap)

    def holds_swaps(self, text: str) -> bool:
        return self._swapped is not None and self._swapped.search(text) is not None


def encode_chats(tokenizer: Tokenizer, texts: Sequence[str], guard: ContentGuard | None,
                 with_offsets: bool = True) -> list[tuple[list[int], list[tuple[int, int]] | None]]:
    """Ids (and each token's character span in its text, ``with_offsets``) of rendered conversations whose
    messages were guarded with ``guard`` (None: nothing was guarded, the text is encoded as the tokenizer reads
    it). The spans refer to the guarded text, which has the length of the real one."""
    if isinstance(tokenizer, HuggingFaceTokenizer):
        encoded = tokenizer.encode_batch_with_offsets(texts)
        if guard is None:
            return encoded
        return [(ids, offs) if not guard.holds_swaps(text) else _reencode_swapped(tokenizer, guard, text, ids, offs)
                for text, (ids, offs) in zip(texts, encoded)]
    return [_encode_split(tokenizer, text, guard) for text in texts]


def _reencode_swapped(tokenizer: HuggingFaceTokenizer, guard: ContentGuard, text: str, ids: list[int],
                      offsets: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
    """The tokenizer's own encoding of ``text`` with every stretch between control tokens that holds a swapped
    character replaced by the plain-text encoding of that stretch, swapped back."""
    # a control token is one the template wrote: its characters spell it (an <unk> a swapped character became
    # is an id of a control token, but not one written there)
    control = {i: t for t, i in tokenizer.control_tokens().items()}
    out_ids: list[int] = []
    out_offsets: list[tuple[int, int]] = []
    run: list[int] = []  # indices of the tokens since the last control token
    start = 0

    def flush(end: int) -> None:
        stretch = text[start:end]
        if guard.holds_swaps(stretch):
            plain = guard.unguard(stretch)
            (plain_ids, plain_offsets), = tokenizer.encode_plain_batch_with_offsets([plain], continuation=start > 0)
            for token, (a, b) in zip(plain_ids, plain_offsets):
                if token in control:  # the model spelled a control token from text: one character at a time
                    for k, ((char_ids, char_offsets),) in enumerate(
                            tokenizer.encode_plain_batch_with_offsets([c], continuation=True) for c in plain[a:b]):
                        out_ids.extend(char_ids)
                        out_offsets.extend((start + a + k, start + a + k + 1) for _ in char_ids)
                else:
                    out_ids.append(token)
                    out_offsets.append((a + start, b + start))
        else:
            out_ids.extend(ids[k] for k in run)
            out_offsets.extend(offsets[k] for k in run)
        run.clear()

    for k, (token, (a, b)) in enumerate(zip(ids, offsets)):
        if token in control and control[token] in text[a:b]:
            flush(a)
            out_ids.append(token)
            out_offsets.append((a, b))
            start = b
        else:
            run.append(k)
    flush(len(text))
    return out_ids, out_offsets


def _encode_split(tokenizer: SentencePieceTokenizer, text: str, guard: ContentGuard | None
                  ) -> tuple[list[int], list[tuple[int, int]]]:
    """A SentencePiece tokenizer: control strings it does not read out of text become their ids, the text between
    them is encoded in one call each, and the characters the guard swapped become their own ids."""
    control = tokenizer.control_tokens()
    unread = sorted((t for t, i in control.items() if i not in tokenizer.encode(t)), key=len, reverse=True)
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    start = 0

    def text_between(end: int) -> None:
        if end > start:
            (part_ids, part_offsets), = tokenizer.encode_batch_with_offsets([text[start:end]])
            part = [(i, (a + start, b + start)) for i, (a, b) in zip(part_ids, part_offsets)]
            if guard is not None and guard.holds_swaps(text[start:end]):
                part = _restore_swapped(tokenizer, guard, text, part)
            ids.extend(i for i, _ in part)
            offsets.extend(span for _, span in part)

    for m in re.finditer("|".join(map(re.escape, unread)), text) if unread else ():
        text_between(m.start())
        ids.append(control[m.group()])
        offsets.append((m.start(), m.end()))
        start = m.end()
    text_between(len(text))
    return ids, offsets


def _restore_swapped(tokenizer: SentencePieceTokenizer, guard: ContentGuard, text: str,
                     tokens: list[tuple[int, tuple[int, int]]]) -> list[tuple[int, tuple[int, int]]]:
    """``tokens`` (id, span in ``text``) with the tokens over a swapped character replaced by that character's
    own ids (SentencePiece: its piece or its bytes), the characters of such a token's span one by one."""
    out: list[tuple[int, tuple[int, int]]] = []
    done = -1  # the characters before this index are already out
    for token, (a, b) in tokens:
        if not guard.holds_swaps(text[a:b]):
            out.append((token, (a, b)))
            continue
        for q in range(max(a, done), b):
            out.extend((i, (q, q + 1)) for i in tokenizer.char_ids(guard.unguard(text[q])))
        done = max(done, b)
    return out
