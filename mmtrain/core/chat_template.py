"""Chat templates: which one, and rendering a conversation -- the one renderer of `mmtrain-prep sft`, the chat rows
of `mmtrain-prep media` and the server's ``/v1/chat/completions`` (generation and evaluation take plain text).

A template is Jinja, rendered the way ``transformers``' ``apply_chat_template`` renders it: a sandboxed
(immutable) environment with ``trim_blocks``/``lstrip_blocks``, loop controls, a ``tojson`` filter that does not
escape HTML, ``raise_exception`` and ``strftime_now``, and the variables ``messages``, ``bos_token``,
``eos_token`` (the strings of the tokenizer's ``tokenizer_config.json``) and ``add_generation_prompt``.
Templates come from the tokenizer folder, i.e. from whoever published it, so they are untrusted code: the sandbox
is not optional, and jinja2 >= 3.1.6 (the releases without known sandbox escapes) is required.

Message text is text: the renderer guards every string of a message (``chat_tokens.ContentGuard``) so that only
the template writes control tokens; ``chat_tokens.encode_chats`` turns the result into ids.

Which characters are the model's own output (they carry the loss) is found in one of two ways:

- ``{% generation %}...{% endgeneration %}`` blocks in the template (what ``transformers`` uses for
  ``return_assistant_tokens_mask``; the built-in templates have them): each block is one assistant span, in
  the order of the assistant messages;
- otherwise prefix by prefix: for assistant message ``i`` the conversation up to message ``i`` rendered with
  the generation prompt must be a prefix of the conversation up to and including it, which must be a prefix of
  the whole rendering; the characters in between are the span. A template that rewrites earlier turns (e.g.
  drops old reasoning) is not prefix-stable; such records are rejected with a reason naming the fix.

A prompt (``render_prompt``) is the conversation with the generation prompt; generation blocks render as their text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from mmtrain.core.chat_tokens import ChatTemplateError, ContentGuard, RenderError, encode_chats, private_char
from mmtrain.core.tokenizer import Tokenizer

# Private markers around each generation block while rendering. Unicode noncharacters: never meaningful text;
# a message that holds one is rejected before rendering (RenderError) so the spans cannot be forged.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# Built-in templates, written for this project with generation blocks: the assistant's content and its end-of-turn
# token carry the loss (so the model learns to stop), the role headers do not.
BUILTIN_TEMPLATES: dict[str, str] = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
        "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}"
        "{{ '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ '<|begin_of_text|>' }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
        "{% if message['role'] == 'assistant' %}"
        "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
        "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
}
# Tokens each built-in needs as single tokens of the tokenizer (checked before any record is read).
BUILTIN_SPECIAL_TOKENS: dict[str, tuple[str, ...]] = {
    "chatml": ("<|im_start|>", "<|im_end|>"),
    "llama3": ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
}


# Tokens that end an assistant turn in the common template families (chatml / Qwen, Llama 3, Phi-3, Gemma,
# GPT-2-style): a chat reply stops at whichever of them its template writes (and the tokenizer has as one token),
# as transformers' generation_config.json lists them for instruct models.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>")


class NoChatTemplateError(ChatTemplateError):
    """``--chat-template tokenizer`` and the tokenizer folder holds no template."""


@dataclass(frozen=True)
class ChatTemplate:
    """``source``: what the user named (``chatml``, ``llama3``, ``tokenizer``, a file); ``text``: the Jinja."""

    source: str
    text: str
    bos_token: str = ""
    eos_token: str = ""

    @property
    def has_generation_blocks(self) -> bool:
        return bool(_GENERATION_TAG.search(self.text))

    def describe(self) -> dict:
        import hashlib

        return {"source": self.source, "sha256": hashlib.sha256(self.text.encode()).hexdigest(),
                "generation_blocks": self.has_generation_blocks}


def _special_token(config: dict, key: str) -> str:
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _tokenizer_folder(tokenizer: str | Path) -> Path:
    path = Path(tokenizer)
    return path if path.is_dir() else path.parent


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"{path}: cannot read the {what} ({exc}); fix or remove it") from None


def _read_config(folder: Path) -> dict:
    config_path = folder / "tokenizer_config.json"
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(_read_text(config_path, "tokenizer config"))
    except ValueError as exc:
        raise ChatTemplateError(f"{config_path}: not valid JSON ({exc}); fix or remove it") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(f"{config_path}: not a JSON object")
    return config


def _template_from_config(folder: Path, config: dict) -> str:
    """The tokenizer's default template: ``chat_template.jinja`` (transformers 5), else ``chat_template`` in
    ``tokenizer_config.json`` (a string, or a list of named templates of which ``default`` is taken)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return _read_text(jinja_file, "chat template")
    value = config.get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if not isinstance(value, str) or not value.strip():
        raise NoChatTemplateError(f"{folder}: the tokenizer has no chat template (no chat_template.jinja, no "
                                  f"chat_template in tokenizer_config.json); pass --chat-template "
                                  f"{' or '.join(BUILTIN_TEMPLATES)} or a .jinja file")
    return value


def load_chat_template(name: str, tokenizer: str | Path) -> ChatTemplate:
    """``name``: ``tokenizer`` (its own template), a built-in (``chatml``, ``llama3``) or a ``.jinja`` file.
    BOS/EOS strings come from the tokenizer's ``tokenizer_config.json`` as ``transformers`` passes them.
    Raises ChatTemplateError (NoChatTemplateError: ``tokenizer`` and it has none)."""
    folder = _tokenizer_folder(tokenizer)
    config = _read_config(folder)
    if name == "tokenizer":
        text = _template_from_config(folder, config)
    elif name in BUILTIN_TEMPLATES:
        text = BUILTIN_TEMPLATES[name]
    else:
        path = Path(name)
        if not path.is_file():
            raise ChatTemplateError(f"--chat-template {name}: neither a built-in ({', '.join(BUILTIN_TEMPLATES)}), "
                                    "'tokenizer', nor a template file")
        text = _read_text(path, "chat template")
    template = ChatTemplate(name, text, _special_token(config, "bos_token"), _special_token(config, "eos_token"))
    compile_template(template.text)  # a syntax error is the user's one-line error now, not a reject per record
    return template


def check_template_tokens(template: ChatTemplate, tokenizer: Tokenizer, source: str) -> None:
    """A built-in template's special tokens must each be one token of ``tokenizer`` (named ``source``)."""
    missing = [t for t in BUILTIN_SPECIAL_TOKENS.get(template.source, ()) if tokenizer.token_id(t) is None]
    if missing:
        raise ChatTemplateError(f"--chat-template {template.source}: tokenizer {source} lacks the template's "
                                f"special token(s) {', '.join(missing)}; use the tokenizer's own template "
                                "(--chat-template tokenizer) or one whose tokens it has")


def compile_template(text: str):
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if tuple(int(x) for x in jinja2.__version__.split(".")[:3] if x.isdigit()) < (3, 1, 6):
        raise ChatTemplateError(f"jinja2 {jinja2.__version__} has known sandbox escapes; chat templates are "
                                "untrusted code: pip install 'jinja2>=3.1.6'")

    class GenerationBlocks(Extension):
        """``{% generation %}body{% endgeneration %}``: the body, between the private span markers."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller) -> str:
            return _OPEN + caller() + _CLOSE

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlocks, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template: Jinja syntax error at line {exc.lineno}: {exc.message}") from None


class ChatRenderer:
    """Renders conversations with one template. ``guard``: makes message text unable to spell control tokens
    (None: message text may hold control tokens -- ``mmtrain-prep sft --parse-special-in-content``). What it
    returns is guarded text, for ``chat_tokens.encode_chats`` with the same guard (``guard.unguard`` gives the
    text a reader sees; the lengths are equal)."""

    def __init__(self, template: ChatTemplate, guard: ContentGuard | None) -> None:
        self.template, self.guard = template, guard
        self._compiled = compile_template(template.text)
        self._blocks = template.has_generation_blocks

    def _guarded(self, messages: list[dict]) -> list[dict]:
        """The messages with every string but the role guarded; a message holding a private noncharacter is
        refused (it could forge a span marker or a guarded character)."""
        out = []
        for i, m in enumerate(messages):
            copy = {}
            for key, value in m.items():
                if isinstance(value, str):
                    bad = private_char(value)
                    if bad is not None:
                        raise RenderError(f"message {i} holds the Unicode noncharacter U+{ord(bad):04X} in its "
                                          f"{key!r}; remove it")
                    if key != "role" and self.guard is not None:
                        value = self.guard.guard(value)
                copy[key] = value
            out.append(copy)
        return out

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        import jinja2

        try:
            return self._compiled.render(messages=messages, bos_token=self.template.bos_token,
                                         eos_token=self.template.eos_token,
                                         add_generation_prompt=add_generation_prompt)
        except jinja2.exceptions.SecurityError as exc:  # the template's fault, not the record's: stop the run
            raise ChatTemplateError(f"chat template {self.template.source}: refused by the sandbox ({exc}); it is "
                                    "not safe to render -- use a built-in template or a reviewed .jinja file") from None
        except Exception as exc:  # noqa: BLE001 - a template's own raise_exception, a type error in it, ...
            raise RenderError(f"chat template failed: {type(exc).__name__}: {exc}"[:300]) from None

    def render_prompt(self, messages: list[dict]) -> str:
        """The conversation followed by the generation prompt (what a model is asked to continue)."""
        text = self._render(self._guarded(messages), add_generation_prompt=True)
        return text.replace(_OPEN, "").replace(_CLOSE, "")

    def render(self, messages: list[dict], trained: list[int]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of the assistant messages whose indices are in
        ``trained`` (each an index into ``messages`` of an assistant message)."""
        messages = self._guarded(messages)
        if self._blocks:
            return self._render_blocks(messages, trained)
        return self._render_prefixes(messages, trained)

    def _render_blocks(self, messages, trained):
        marked = self._render(messages, add_generation_prompt=False)
        text, spans, depth, length, start = [], [], 0, 0, 0
        for piece in re.split(f"([{_OPEN}{_CLOSE}])", marked):
            if piece == _OPEN:
                depth += 1
                if depth == 1:
                    start = length
            elif piece == _CLOSE:
                depth -= 1
                if depth == 0:
                    spans.append((start, length))
            else:
                text.append(piece)
                length += len(piece)
        assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if len(spans) != len(assistants):
            raise RenderError(f"the template's generation blocks ({len(spans)}) do not match the assistant "
                              f"messages ({len(assistants)})")
        wanted = set(trained)
        chosen = [span for i, span in zip(assistants, spans) if i in wanted]
        return "".join(text), chosen

    def _render_prefixes(self, messages, trained):
        full = self._render(messages, add_generation_prompt=False)
        spans = []
        for i in trained:
            before = self._render(messages[:i], add_generation_prompt=True)
            through = self._render(messages[:i + 1], add_generation_prompt=False)
            if not (through.startswith(before) and full.startswith(through)):
                raise RenderError(f"the chat template is not prefix-stable at message {i} (it renders earlier turns "
                                  "differently once later ones follow), so the assistant tokens cannot be found; "
                                  "use a template with {% generation %} blocks (--chat-template FILE)")
            spans.append((len(before), len(through)))
        return full, spans


class ChatPrompts:
    """Chat messages -> the prompt's token ids (the server's ``/v1/chat/completions``): rendered with the
    generation prompt and encoded so that only the template makes control tokens -- the ids ``transformers``'
    ``apply_chat_template(..., add_generation_prompt=True, tokenize=True)`` gives for ordinary messages, and the
    prompt tokens of `mmtrain-prep sft` for the same conversation. Raises RenderError for one request's
    messages, ChatTemplateError for the template."""

    def __init__(self, template: ChatTemplate, tokenizer: Tokenizer) -> None:
        self.template, self.tokenizer = template, tokenizer
        self.renderer = ChatRenderer(template, ContentGuard(tokenizer.control_tokens()))

    def stop_ids(self) -> tuple[int, ...]:
        """Where a chat reply ends besides the end-of-document id: the template's ``eos_token`` and each known
        end-of-turn token the template writes, where the tokenizer has it as one token."""
        names = [self.template.eos_token, *(t for t in END_OF_TURN_TOKENS if t in self.template.text)]
        ids = (self.tokenizer.token_id(name) for name in names if name)
        return tuple(sorted({i for i in ids if i is not None}))

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self.renderer.render_prompt(messages)
        return encode_chats(self.tokenizer, [text], self.renderer.guard, with_offsets=False)[0][0]
