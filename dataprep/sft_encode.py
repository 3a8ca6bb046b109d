"""Worker side of `mmtrain-prep sft`: one block of JSONL lines -> token arrays, loss masks, rejects, counts.

Per record: parse (``sft_records``), render with the chat template and find the trained assistant messages'
character spans (``mmtrain.core.chat_template``); then the whole block is tokenized in one batch call with
character offsets (``mmtrain.core.chat_tokens``: message text never becomes control tokens unless
``--parse-special-in-content``), and a token carries the loss when its characters overlap a span -- the rule
``transformers`` applies to ``return_assistant_tokens_mask``, on the same text and tokenizer. Tokens of a record
and its mask have the same length and land in parallel outputs (``tokens`` + ``loss_mask``; for preference data
``chosen``/``rejected`` and their masks), so document ``i`` of each output belongs to record ``i``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass

import numpy as np

from dataprep.sft_records import Conversation, RecordError, preference_pair, sft_conversation
from dataprep.text_encode import EncodedBlock, Reject, excerpt
from dataprep.text_input import Block, split_lines
from mmtrain.core.chat_template import ChatRenderer, ChatTemplate
from mmtrain.core.chat_tokens import ContentGuard, RenderError, encode_chats, private_char
from mmtrain.core.tokenizer import Tokenizer, load_tokenizer

MASK_DTYPE = "uint8"
IDENTICAL_PAIR = ("chosen and rejected are the same tokens: a zero-gradient pair, DPO learns nothing from it "
                  "(it is written; fix or drop the record)")


def output_keys(preference: bool) -> tuple[str, ...]:
    """The parallel outputs, token outputs first then their masks (``KEY_loss_mask``)."""
    return ("chosen", "rejected", "chosen_loss_mask", "rejected_loss_mask") if preference \
        else ("tokens", "loss_mask")


def mask_key(key: str) -> str:
    return "loss_mask" if key == "tokens" else f"{key}_loss_mask"


@dataclass(frozen=True)
class ChatEncodeOptions:
    tokenizer: str
    tokenizer_type: str | None
    template: ChatTemplate | None  # None: prompt + completion as plain text (--chat-template none)
    preference: bool
    loss_on: str  # "assistant" | "all"
    max_length: int | None
    append_eod: bool
    eod_id: int | None
    dtype: str
    threads: int = 1
    merge_file: str | None = None
    parse_special_in_content: bool = False  # message text may hold control tokens (off: it is plain text)


@dataclass
class ChatBlock(EncodedBlock):
    loss_tokens: int = 0

    @property
    def token_count(self) -> int:  # the masks are not tokens
        return sum(int(self.tokens[k].size) for k in self.tokens if not k.endswith("loss_mask"))


def loss_mask_from_spans(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for every token whose characters ``[start, end)`` overlap one of ``spans``."""
    mask = np.zeros(len(offsets), np.uint8)
    if not offsets:
        return mask
    starts, ends = (np.asarray(x, np.int64) for x in zip(*offsets))
    for a, b in spans:
        if b > a:
            mask |= ((starts < b) & (ends > a)).astype(np.uint8)
    return mask


class ChatBlockEncoder:
    """Holds the tokenizer and the compiled template (one per process) and encodes blocks."""

    def __init__(self, options: ChatEncodeOptions, tokenizer: Tokenizer | None = None) -> None:
        self.options = options
        self.tokenizer = tokenizer or load_tokenizer(options.tokenizer, options.tokenizer_type,
                                                     merge_file=options.merge_file)
        self.tokenizer.set_threads(options.threads)
        self.guard = None if options.parse_special_in_content else ContentGuard(self.tokenizer.control_tokens())
        self.renderer = ChatRenderer(options.template, self.guard) if options.template is not None else None
        self.dtype = np.dtype(options.dtype)
        self.keys = output_keys(options.preference)

    def _render(self, conv: Conversation) -> tuple[str, list[tuple[int, int]]]:
        if self.renderer is None:
            if not conv.prompt_completion:
                raise RecordError("needs_template", "--chat-template none takes only prompt/completion strings; "
                                                    "conversations need a chat template")
            prompt, completion = conv.messages[0]["content"], conv.messages[1]["content"]
            text = prompt + completion
            if self.guard is not None:  # plain text too: a prompt's '<|im_start|>' is not that token
                bad = private_char(text)
                if bad is not None:
                    raise RecordError("template_error", f"the record holds the Unicode noncharacter "
                                                        f"U+{ord(bad):04X}; remove it")
                text = self.guard.guard(prompt) + self.guard.guard(completion)
            return text, [(len(prompt), len(prompt) + len(completion))]
        try:
            return self.renderer.render(conv.messages, conv.trained)
        except RenderError as exc:
            raise RecordError("template_error", str(exc)) from None

    def _parse(self, raw: bytes, first: bool):
        if first and raw.startswith(b"\xef\xbb\xbf"):
            raw = raw[3:]
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise RecordError("invalid_utf8", f"invalid UTF-8 at byte {exc.start} of the line; re-encode the file "
                                              "as UTF-8") from None
        except json.JSONDecodeError as exc:
            raise RecordError("malformed_json", f"malformed JSON: {exc.msg} at column {exc.colno}") from None
        except RecursionError:
            raise RecordError("malformed_json", "malformed JSON: nested too deeply to parse") from None
        except ValueError:
            raise RecordError("malformed_json", f"malformed JSON: an integer with more than "
                                                f"{sys.get_int_max_str_digits()} digits") from None
        convs = preference_pair(obj) if self.options.preference else (sft_conversation(obj),)
        rendered = [self._render(c) for c in convs]
        for text, _ in rendered:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise RecordError("lone_surrogate", f"a lone surrogate (\\u{ord(text[exc.start]):04x} escape) in "
                                                    "the record: not valid Unicode; fix the JSON escape") from None
        return rendered

    def _tokenize(self, texts: list[str]) -> list:
        try:
            return encode_chats(self.tokenizer, texts, self.guard)
        except Exception:  # noqa: BLE001 - one by one below, so only the refused record is rejected
            out = []
            for t in texts:
                try:
                    out.append(encode_chats(self.tokenizer, [t], self.guard)[0])
                except Exception as exc:  # noqa: BLE001
                    out.append(RecordError("tokenizer_error", f"tokenizer refused the record: "
                                                              f"{type(exc).__name__}: {exc}"[:300]))
            return out

    def encode(self, block: Block) -> ChatBlock:
        out = ChatBlock(block.file_index, block.first_line, len(block.data))
        lines = split_lines(block.data)
        rendered, where = [], []
        for i, raw in enumerate(lines):
            if not raw.strip():
                out.blank += 1
                continue
            out.records += 1
            try:
                rendered.append(self._parse(raw, i == 0 and block.first_line == 1))
                where.append(i)
            except RecordError as exc:
                out.rejects.append(Reject(block.first_line + i, str(exc), excerpt(raw), exc.code))
        per_record = len(rendered[0]) if rendered else 0
        encoded = self._tokenize([text for r in rendered for text, _ in r])
        ids: dict[str, list[np.ndarray]] = {k: [] for k in self.keys}
        for j, record in enumerate(rendered):
            parts = encoded[j * per_record:(j + 1) * per_record]
            try:
                arrays = [self._arrays(part, spans) for part, (_, spans) in zip(parts, record)]
            except RecordError as exc:
                out.rejects.append(Reject(block.first_line + where[j], str(exc), excerpt(lines[where[j]]), exc.code))
                continue
            if per_record == 2 and all(np.array_equal(a, b) for a, b in zip(*arrays)):
                out.warnings.append(Reject(block.first_line + where[j], IDENTICAL_PAIR, excerpt(lines[where[j]]),
                                           "identical_pair"))
            token_keys = self.keys[:per_record]
            for key, (tokens, mask) in zip(token_keys, arrays):
                ids[key].append(tokens)
                ids[mask_key(key)].append(mask)
                out.loss_tokens += int(mask.sum())
        out.rejects.sort(key=lambda r: r.line)
        for key in self.keys:
            dtype = np.dtype(MASK_DTYPE) if key.endswith("loss_mask") else self.dtype
            arrays = ids[key]
            out.tokens[key] = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)
            out.lengths[key] = np.fromiter(map(len, arrays), np.int32, count=len(arrays))
        return out

    def _arrays(self, part, spans) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(part, RecordError):
            raise part
        token_ids, offsets = part
        mask = loss_mask_from_spans(offsets, spans) if self.options.loss_on == "assistant" \
            else np.ones(len(token_ids), np.uint8)
        tokens = np.asarray(token_ids, self.dtype)
        if self.options.append_eod:
            tokens = np.append(tokens, np.asarray(self.options.eod_id, self.dtype))
            mask = np.append(mask, np.uint8(1))  # the end of the answer is the model's to predict
        if not mask.any():
            raise RecordError("no_loss_tokens", "no token carries the loss (the assistant text is empty or the "
                                                "template drops it)")
        limit = self.options.max_length
        if limit is not None and tokens.size > limit:
            raise RecordError("too_long", f"{tokens.size:,} tokens, more than --max-length {limit:,}")
        return tokens, mask
