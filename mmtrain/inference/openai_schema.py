"""Request bodies of the OpenAI-compatible API (pydantic, strict): unknown fields and wrong types are refused,
so a client's typo is a 400 naming the field rather than a silently ignored option. Numbers must be finite (JSON's
NaN / Infinity extensions are refused) and every string must be Unicode text (JSON can escape a lone UTF-16
surrogate, ``"\\ud800"``, which no tokenizer can encode)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_STOPS = 16  # stop strings per request, each of at most MAX_STOP_CHARS: every new token is checked against them
MAX_STOP_CHARS = 1024


def _unicode_text(value: str) -> str:
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"character {exc.start} is a lone UTF-16 surrogate "
                             f"(\\u{ord(value[exc.start]):04x}), not Unicode text") from None
    return value


def _stop_text(value: str) -> str:
    if len(value) > MAX_STOP_CHARS:
        raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, not {len(value)}")
    return _unicode_text(value)


Text = Annotated[str, AfterValidator(_unicode_text)]
StopText = Annotated[str, AfterValidator(_stop_text)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: Text | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # not in OpenAI's API; vLLM-style extension
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOPS)] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: Literal[1] = 1
    user: Text | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Request):
    """POST /v1/completions: ``prompt`` is text or token ids. ``max_tokens`` defaults to 16, as OpenAI's."""

    prompt: Text | list[int]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text
    name: Text | None = None


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions (when the tokenizer has a chat template). ``max_tokens`` defaults to what the
    context leaves after the prompt; ``max_completion_tokens`` is its newer name."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
