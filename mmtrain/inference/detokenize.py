"""A completion's text, decoded a few tokens at a time: the text a client must append to the prompt's text to get
the decode of prompt + completion.

A tokenizer's decode is not a concatenation of per-token strings. SentencePiece drops the leading space of the
first piece it decodes (``decode([▁the])`` is ``"the"``, so decoding the completion alone loses the space that
separates it from the prompt), and byte-level or byte-fallback tokens split one character over several tokens.
So the completion's text is ``decode(prompt + completion)[len(decode(prompt)):]`` in effect, computed on a window
(the prefix offset of vLLM and TGI): decode the window with and without the new tokens and take the difference.
Per token that costs two decodes of a few tokens, not a decode of the whole sequence.

The difference is exact when the window starts where the tokenizer's start-of-text rule no longer reaches the
new tokens: the window's tokens before the new ones must decode to some text (SentencePiece drops the leading
space of every piece until the text is non-empty when it collapses whitespace; a Hugging Face ``Strip`` decoder
strips the start of the whole text). Text that ends in an incomplete UTF-8 character (U+FFFD) waits for the
token that completes it, unless the sequence has finished. A prompt given as token ids may end inside a
character that the completion completes: the completion's text then begins with that whole character, and
``prompt_end`` says how many prompt tokens have their text before it (what ``echo`` shows).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]

REPLACEMENT = "\ufffd"  # what decoders give for the bytes of an incomplete (or invalid) character
# a character is at most 4 UTF-8 bytes, so an incomplete one at the prompt's end lies in its last 3 tokens
_CHAR_TOKENS = 3
_CONTEXT = 5  # prompt tokens before those: the new tokens' left context in the first window


class CompletionText:
    """The incremental detokenizer of one sequence. ``update(completion_ids, finished)`` takes the completion's
    ids so far (the same list, grown) and returns its text so far; the text only ever grows."""

    def __init__(self, prompt_ids: Sequence[int], decode: Decode) -> None:
        self.decode = decode
        self.prompt = list(prompt_ids)
        self.text = ""
        n = len(self.prompt)
        self.prompt_end = n  # prompt tokens whose text comes before the completion's
        # a cut inside the prompt's last tokens (an incomplete character) must still leave text before it
        self._stable = max(0, n - _CHAR_TOKENS)
        start = max(0, self._stable - _CONTEXT)
        while start > 0 and not decode(self.prompt[start:self._stable]):
            start = max(0, 2 * start - self._stable)  # its tokens decode to nothing (control tokens): widen
        self._start, self._read = start, n  # the window's start and the end of the tokens taken as text
        self._before = decode(self.prompt[start:n])  # the window's text up to _read

    def _ids(self, completion: Sequence[int], start: int) -> list[int]:
        """Prompt + completion from position ``start`` on."""
        n = len(self.prompt)
        return self.prompt[start:] + list(completion) if start < n else list(completion[start - n:])

    def update(self, completion: Sequence[int], finished: bool = False) -> str:
        end = len(self.prompt) + len(completion)
        if end == self._read:
            return self.text
        window = self.decode(self._ids(completion, self._start))
        if not finished and window.endswith(REPLACEMENT):
            return self.text  # an incomplete character: wait for the token that completes it
        before = self._before
        if not window.startswith(before) and self._read == len(self.prompt):
            before = self._rewind(window)
        self.text += window[len(before):]
        taken = self.decode(self._ids(completion, self._read))
        if taken:  # these tokens decode to text on their own: the next window may start at them
            self._start, self._before = self._read, taken
        else:
            self._before = window
        self._read = end
        return self.text

    def _rewind(self, window: str) -> str:
        """The prompt ended inside a character that the new tokens complete: cut the prompt before it (the
        latest cut whose text the window keeps). Returns the window's text up to the cut."""
        for cut in range(len(self.prompt) - 1, self._stable - 1, -1):
            before = self.decode(self.prompt[self._start:cut])
            if window.startswith(before):
                self._read = self.prompt_end = cut
                return before
        return self._before  # no cut keeps the text before it: take the difference in length
