"""Chat rows of `mmtrain-prep media`: a conversation with images in its user turns -> chat-template tokens with
one image slot per image and the loss mask on the assistant tokens (the text SFT rules of `mmtrain-prep sft`).

The row's messages carry ``IMAGE_PLACEHOLDER`` where each image goes (`media_manifest` put it there). The
conversation is rendered with the chat template exactly as text SFT renders it (``mmtrain.core.chat_template``:
the tokenizer's own Jinja, ``chatml`` or ``llama3``; message text is text, never control tokens, except the
placeholders), the assistant character spans come with it (assistant messages of weight 0 carry no loss), and
the text between placeholders is tokenized piece by piece with character offsets; each placeholder becomes one slot
``IMAGE_SLOT`` (-1) in the token list. Tokenizing the pieces apart is what a tokenizer does around an added
special token (``transformers`` splits the text there too), so with the placeholder registered as a special
token the ids equal ``apply_chat_template``'s with that token's id at the slots (the tests check it). The
loader expands each slot to the model's ``tokens_per_image`` image placeholders (`mmtrain.data.multimodal`),
so the shards do not depend on the vision shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from dataprep.media_manifest import IMAGE_PLACEHOLDER, MediaRow
from dataprep.sft_encode import loss_mask_from_spans
from mmtrain.core.chat_template import ChatRenderer, ChatTemplate, check_template_tokens, load_chat_template
from mmtrain.core.chat_tokens import ContentGuard, RenderError, encode_chats
from mmtrain.core.tokenizer import load_tokenizer

IMAGE_SLOT = -1  # an image's place in a chat sample's stored tokens


class ChatRowError(ValueError):
    """One chat row that cannot be encoded: ``code`` for rejects.jsonl and a reason naming the fix."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


@dataclass(frozen=True)
class ChatMediaOptions:
    """What a chat row needs: the tokenizer, the template, and the longest sample to keep (tokens, each image one
    slot; None: no limit)."""

    tokenizer: str
    template: str = "tokenizer"
    max_length: int | None = None


class ChatRowEncoder:
    """Renders and tokenizes chat rows in the main process (cheap next to decoding the images)."""

    def __init__(self, options: ChatMediaOptions) -> None:
        self.options = options
        self.tokenizer = load_tokenizer(options.tokenizer)
        self.tokenizer.encode_batch_with_offsets(["check"])  # a tokenizer without offsets fails here, with its fix
        self.template: ChatTemplate = load_chat_template(options.template, options.tokenizer)
        check_template_tokens(self.template, self.tokenizer, options.tokenizer)
        # the placeholders are ours (a text part holding one is refused), the rest of a message is text
        self.guard = ContentGuard(self.tokenizer.control_tokens(), keep=(IMAGE_PLACEHOLDER,))
        self.renderer = ChatRenderer(self.template, self.guard)
        self.tokenizer_sha256 = self.tokenizer.checksum()

    def describe(self) -> dict:
        return {"tokenizer": self.tokenizer.describe(), "chat_template": self.template.describe(),
                "image_placeholder": IMAGE_PLACEHOLDER, "image_slot": IMAGE_SLOT,
                "max_length": self.options.max_length}

    def encode(self, row: MediaRow) -> dict:
        """``{"tokens": [...], "loss_mask": [...], "tokenizer_sha256": ...}`` (equal lengths; ``IMAGE_SLOT`` with
        mask 0 per image, in order; the loader checks the run's tokenizer against the hash), or ChatRowError."""
        messages = [{"role": m["role"], "content": m["content"]} for m in row.conversation]
        trained = [i for i, m in enumerate(row.conversation) if m["role"] == "assistant" and m.get("weight", 1) != 0]
        try:
            text, spans = self.renderer.render(messages, trained)
        except RenderError as exc:
            raise ChatRowError("template_error", str(exc)) from None
        pieces = text.split(IMAGE_PLACEHOLDER)
        if len(pieces) - 1 != len(row.images):
            raise ChatRowError("template_error", f"the chat template rendered {len(pieces) - 1} {IMAGE_PLACEHOLDER!r} "
                               f"placeholder(s) for {len(row.images)} image(s); it must keep each message's text")
        try:
            encoded = encode_chats(self.tokenizer, pieces, self.guard)
        except Exception as exc:  # noqa: BLE001 - one refused record is a reject, not the end of the run
            raise ChatRowError("tokenizer_error", f"tokenizer refused the record: {type(exc).__name__}: {exc}"[:300]) \
                from None
        tokens, offsets, start = [], [], 0
        for k, (ids, offs) in enumerate(encoded):
            if k:
                tokens.append(IMAGE_SLOT)
                offsets.append((start - len(IMAGE_PLACEHOLDER), start - len(IMAGE_PLACEHOLDER)))  # empty: no loss
            tokens += ids
            offsets += [(a + start, b + start) for a, b in offs]
            start += len(pieces[k]) + len(IMAGE_PLACEHOLDER)
        mask = [0 if t == IMAGE_SLOT else int(m) for t, m in zip(tokens, loss_mask_from_spans(offsets, spans))]
        if not any(mask):
            raise ChatRowError("no_loss_tokens", "no token carries the loss (the assistant text is empty or the "
                               "template drops it)")
        limit = self.options.max_length
        if limit is not None and len(tokens) > limit:
            raise ChatRowError("too_long", f"{len(tokens):,} tokens (each image one), more than --max-length "
                               f"{limit:,}")
        return {"tokens": tokens, "loss_mask": mask, "tokenizer_sha256": self.tokenizer_sha256}
