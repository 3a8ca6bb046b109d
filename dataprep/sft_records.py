"""Records of `mmtrain-prep sft`: one JSON object -> conversation(s) in one shape, or a reject reason.

Accepted shapes (detected per record, so one file may mix them):

- OpenAI: ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}``
- ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}`` (``user`` and
  ``assistant`` are accepted as ``from`` too)
- prompt/completion: ``{"prompt": "...", "completion": "..."}`` -> a user turn and an assistant turn
- preference (``--preference``): ``{"prompt": ..., "chosen": ..., "rejected": ...}`` where each of the three
  is a string or a message list in either shape; or ``{"chosen": [...], "rejected": [...]}`` as two whole
  conversations, whose shared leading messages are the prompt.

A :class:`Conversation` carries the messages and which assistant messages are trained (carry the loss): every
assistant message for SFT; for preference data only those of the chosen/rejected answer, never the prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("system", "user", "assistant")
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


class RecordError(ValueError):
    """``code`` is the reject category; the message names the key and what is wrong."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass
class Conversation:
    messages: list[dict]  # {"role", "content"} only
    trained: list[int]  # indices of the assistant messages that carry the loss
    prompt_completion: bool = False  # from prompt/completion strings (the only shape --chat-template none takes)


def _kind(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
            bool: "a boolean", type(None): "null"}.get(type(value), type(value).__name__)


def _messages(value, key: str) -> list[dict]:
    """A message list in OpenAI or ShareGPT shape -> [{"role", "content"}]."""
    if not isinstance(value, list):
        raise RecordError("bad_messages", f"key {key!r} holds {_kind(value)}, not a list of messages")
    if not value:
        raise RecordError("bad_messages", f"key {key!r} is an empty list of messages")
    out = []
    for i, m in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(m, dict):
            raise RecordError("bad_messages", f"{where} is {_kind(m)}, not a message object")
        if "role" in m:
            role, content, content_key = m["role"], m.get("content"), "content"
            if role not in ROLES:
                raise RecordError("bad_role", f"{where}.role is {str(role)[:40]!r}; roles are {', '.join(ROLES)}")
        elif "from" in m:
            speaker, content, content_key = m["from"], m.get("value"), "value"
            role = _SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
            if role is None:
                raise RecordError("bad_role", f"{where}.from is {str(speaker)[:40]!r}; ShareGPT speakers are "
                                              f"{', '.join(_SHAREGPT_ROLES)}")
        else:
            raise RecordError("bad_messages", f"{where} has neither 'role' (OpenAI) nor 'from' (ShareGPT)")
        if not isinstance(content, str):
            hint = "; images and audio go through mmtrain-prep media" if isinstance(content, list) else ""
            raise RecordError("not_a_string", f"{where}.{content_key} holds {_kind(content)}, not a string{hint}")
        out.append({"role": role, "content": content})
    return out


def _string_or_messages(obj: dict, key: str, role: str) -> list[dict]:
    value = obj[key]
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, key)


def _assistant_indices(messages: list[dict], start: int = 0) -> list[int]:
    return [i for i in range(start, len(messages)) if messages[i]["role"] == "assistant"]


def _require_trained(conv: Conversation, key: str) -> Conversation:
    if not conv.trained:
        raise RecordError("no_assistant_turn", f"{key} has no assistant message to train on")
    return conv


def sft_conversation(obj) -> Conversation:
    if not isinstance(obj, dict):
        raise RecordError("not_an_object", f"the line is {_kind(obj)}, not a JSON object")
    if "messages" in obj:
        messages = _messages(obj["messages"], "messages")
        return _require_trained(Conversation(messages, _assistant_indices(messages)), "'messages'")
    if "conversations" in obj:
        messages = _messages(obj["conversations"], "conversations")
        return _require_trained(Conversation(messages, _assistant_indices(messages)), "'conversations'")
    if "prompt" in obj and "completion" in obj:
        for key in ("prompt", "completion"):
            if not isinstance(obj[key], str):
                raise RecordError("not_a_string", f"key {key!r} holds {_kind(obj[key])}, not a string")
        return Conversation([{"role": "user", "content": obj["prompt"]},
                             {"role": "assistant", "content": obj["completion"]}], [1], prompt_completion=True)
    present = ", ".join(k[:40] for k in sorted(obj)[:8]) or "none"
    raise RecordError("missing_key", f"no 'messages', 'conversations' or 'prompt'+'completion' (keys present: "
                                     f"{present})")


def preference_pair(obj) -> tuple[Conversation, Conversation]:
    """(chosen, rejected) conversations: the same prompt, each trained only on its own answer."""
    if not isinstance(obj, dict):
        raise RecordError("not_an_object", f"the line is {_kind(obj)}, not a JSON object")
    for key in ("chosen", "rejected"):
        if key not in obj:
            present = ", ".join(k[:40] for k in sorted(obj)[:8]) or "none"
            raise RecordError("missing_key", f"missing key {key!r} (keys present: {present}); preference records "
                                             "hold 'prompt', 'chosen', 'rejected'")
    if "prompt" in obj:
        prompt = _string_or_messages(obj, "prompt", "user")
        pair = []
        for key in ("chosen", "rejected"):
            answer = _string_or_messages(obj, key, "assistant")
            messages = prompt + answer
            pair.append(_require_trained(Conversation(messages, _assistant_indices(messages, len(prompt)),
                                                      isinstance(obj["prompt"], str) and len(answer) == 1),
                                         f"{key!r}"))
        return pair[0], pair[1]
    chosen, rejected = _messages(obj["chosen"], "chosen"), _messages(obj["rejected"], "rejected")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == 0:
        raise RecordError("no_shared_prompt", "'chosen' and 'rejected' share no leading message (the prompt); "
                                              "give the prompt as 'prompt'")
    return (_require_trained(Conversation(chosen, _assistant_indices(chosen, shared)), "'chosen' after the prompt"),
            _require_trained(Conversation(rejected, _assistant_indices(rejected, shared)),
                             "'rejected' after the prompt"))
