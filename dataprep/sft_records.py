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
assistant message for SFT; for preference data only those of the chosen/rejected answer, never the prompt's. An
assistant message with ``"weight": 0`` (OpenAI's fine-tuning format; ``1`` is the default) is never trained.
"""

from __future__ import annotations

import json
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


def message_weight(m: dict, role: str, where: str) -> str | None:
    """What is wrong with message ``m``'s ``weight`` (None: nothing; absent is 1). Shared with the media chat rows."""
    if "weight" not in m:
        return None
    weight = m["weight"]
    if isinstance(weight, bool) or weight not in (0, 1):
        return f"{where}.weight is {json.dumps(weight)[:40]}; weight is 0 (no loss on this message) or 1"
    if role != "assistant":
        return f"{where}.weight is set on a {role} message; only assistant messages carry a weight"
    return None


def _messages(value, key: str) -> list[dict]:
    """A message list in OpenAI or ShareGPT shape -> [{"role", "content"}], plus ``"weight": 0`` on an assistant
    message that must not be trained (``_conversation`` takes it off)."""
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
        problem = message_weight(m, role, where)
        if problem is not None:
            raise RecordError("bad_weight", problem)
        out.append({"role": role, "content": content, **({"weight": 0} if m.get("weight") == 0 else {})})
    return out


def _string_or_messages(obj: dict, key: str, role: str) -> list[dict]:
    value = obj[key]
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return _messages(value, key)


def _conversation(messages: list[dict], start: int = 0, prompt_completion: bool = False) -> Conversation:
    """The conversation training the assistant messages from ``start`` on, except those of weight 0."""
    trained = [i for i in range(start, len(messages))
               if messages[i]["role"] == "assistant" and messages[i].get("weight", 1) != 0]
    return Conversation([{"role": m["role"], "content": m["content"]} for m in messages], trained,
                        prompt_completion)


def _require_trained(conv: Conversation, key: str) -> Conversation:
    if not conv.trained:
        raise RecordError("no_assistant_turn", f"{key} has no assistant message to train on (weight 0 ones "
                                               "are not trained)")
    return conv


def sft_conversation(obj) -> Conversation:
    if not isinstance(obj, dict):
        raise RecordError("not_an_object", f"the line is {_kind(obj)}, not a JSON object")
    if "messages" in obj:
        return _require_trained(_conversation(_messages(obj["messages"], "messages")), "'messages'")
    if "conversations" in obj:
        return _require_trained(_conversation(_messages(obj["conversations"], "conversations")), "'conversations'")
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
            pair.append(_require_trained(_conversation(prompt + answer, len(prompt),
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
    return (_require_trained(_conversation(chosen, shared), "'chosen' after the prompt"),
            _require_trained(_conversation(rejected, shared), "'rejected' after the prompt"))
