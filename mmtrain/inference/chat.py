"""Chat prompts: the tokenizer's own chat template (``chat_template`` in the ``tokenizer_config.json`` next to its
``tokenizer.json``, the Hugging Face convention), rendered in Jinja's sandbox (a template is code from a file)."""

from __future__ import annotations

import json
from pathlib import Path


class ChatTemplateError(ValueError):
    """A chat template that cannot be read or rendered; the message names the file."""


def load_chat_template(tokenizer_path: str | Path) -> str | None:
    """The chat template of the tokenizer at ``tokenizer_path`` (a file or its folder), or None when it has none."""
    path = Path(tokenizer_path)
    config = (path if path.is_dir() else path.parent) / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"{config}: not valid JSON ({exc})") from None
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # the named-templates form: take "default"
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if template is not None and not isinstance(template, str):
        raise ChatTemplateError(f"{config}: chat_template is not a string")
    return template


class ChatRenderer:
    """``render(messages)`` -> the prompt text, with the generation prompt appended."""

    def __init__(self, template: str, special_tokens: dict[str, str] | None = None) -> None:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self._errors = TemplateError
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message):
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(template)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        self._special = special_tokens or {}

    def render(self, messages: list[dict[str, str]]) -> str:
        try:
            return self._template.render(messages=messages, add_generation_prompt=True, **self._special)
        except self._errors as exc:
            raise ChatTemplateError(f"the chat template refused these messages: {exc}") from None
