"""Request bodies of the OpenAI-compatible API (pydantic, strict): unknown fields and wrong types are refused,
so a client's typo is a 400 naming the field rather than a silently ignored option."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # not in OpenAI's API; vLLM-style extension
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict | None = None
    n: Literal[1] = 1
    user: str | None = None

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_Request):
    """POST /v1/completions: ``prompt`` is text or token ids. ``max_tokens`` defaults to 16, as OpenAI's."""

    prompt: str | list[int]
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str
    name: str | None = None


class ChatCompletionRequest(_Request):
    """POST /v1/chat/completions (when the tokenizer has a chat template). ``max_tokens`` defaults to what the
    context leaves after the prompt; ``max_completion_tokens`` is its newer name."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
