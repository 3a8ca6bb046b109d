"""A small chat tokenizer (byte-level BPE with the chatml / llama3 special tokens) and chat data for the
post-training tests."""

from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eot_id|>"]
# A Zephyr-like template without generation blocks: the assistant spans are found prefix by prefix, so a span is
# everything the template renders for the message after the generation prompt (here the newline after eos too);
# the tagged twin says exactly that to transformers.
OWN_TEMPLATE = ("{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] "
                "+ eos_token + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")
OWN_TEMPLATE_TAGGED = ("{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' }}"
                       "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + eos_token + '\\n' }}"
                       "{% endgeneration %}{% else %}{{ message['content'] + eos_token + '\\n' }}{% endif %}"
                       "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help?"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "and 3+3 ünïcödé 🙂?"}, {"role": "assistant", "content": " 6, of course.\n"}],
]
VOCAB = 600  # the tokenizer's size; models in the tests use a vocabulary of at least this


def build_chat_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["system user assistant the of and"] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": OWN_TEMPLATE}))
    return folder


def toy_conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` conversations of varied lengths (1-3 exchanges), deterministic."""
    import random

    rng = random.Random(seed)
    words = "the cat sat on a mat and then it ran to the big red house of my friend".split()
    out = []
    for _ in range(n):
        conv = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.3 else []
        for _ in range(rng.randint(1, 3)):
            conv.append({"role": "user", "content": " ".join(rng.choices(words, k=rng.randint(2, 8)))})
            conv.append({"role": "assistant", "content": " ".join(rng.choices(words, k=rng.randint(1, 10)))})
        out.append(conv)
    return out


def write_sft_dataset(folder: Path, tokenizer: Path, conversations, template: str = "chatml") -> Path:
    """`mmtrain-prep sft` over ``conversations``; returns the output prefix."""
    from dataprep.cli import main as prep

    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "chat.jsonl"
    src.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    prefix = folder / "sft"
    assert prep(["sft", "--input", str(src), "--output-prefix", str(prefix), "--tokenizer", str(tokenizer),
                 "--chat-template", template, "--workers", "0", "--progress", "never"]) == 0
    return prefix


def write_preference_dataset(folder: Path, pairs: int = 16) -> Path:
    """A toy preference set (chosen answers start with "yes", rejected with "no"), prepared with chatml."""
    import numpy as np

    from dataprep.cli import main as prep

    tok = build_chat_tokenizer(folder / "tok")
    rng = np.random.default_rng(0)
    words = "the cat sat on a mat and ran to the big red house".split()
    records = [{"prompt": " ".join(rng.choice(words, 4)), "chosen": "yes " + " ".join(rng.choice(words, 3)),
                "rejected": "no " + " ".join(rng.choice(words, 3))} for _ in range(pairs)]
    src = folder / "pref.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert prep(["sft", "--preference", "--input", str(src), "--output-prefix", str(folder / "p"), "--tokenizer",
                 str(tok), "--chat-template", "chatml", "--workers", "0", "--progress", "never"]) == 0
    return folder / "p"


IMAGE_TOKEN = "<image>"  # the chat tokenizer's image placeholder (a special token added after training)

# Conversations with images in their user turns (and one without), in the OpenAI content-part shape; the ShareGPT
# twin of each is written by ``sharegpt_twin``.
IMAGE_CONVERSATIONS = [
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "img/red.png"}},
                                  {"type": "text", "text": "\nWhat colour is this?"}]},
     {"role": "assistant", "content": "Red, mostly."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "image", "path": "img/blue.jpg"},
                                  {"type": "text", "text": " and "}, {"type": "image", "path": "img/red.png"}]},
     {"role": "assistant", "content": "Blue, then red."},
     {"role": "user", "content": "Which is warmer?"}, {"role": "assistant", "content": " The red one.\n"}],
    [{"role": "user", "content": "No picture this time: 2+2?"}, {"role": "assistant", "content": "4"}],  # text only
]


def image_texts(conversation: list[dict]) -> list[dict]:
    """The conversation with each image part written as IMAGE_TOKEN (what the template renders), text only."""
    out = []
    for m in conversation:
        content = m["content"]
        if isinstance(content, list):
            content = "".join(p["text"] if p["type"] == "text" else IMAGE_TOKEN for p in content)
        out.append({"role": m["role"], "content": content})
    return out


def image_paths(conversation: list[dict]) -> list[str]:
    return [p.get("path") or p["image_url"]["url"] for m in conversation if isinstance(m["content"], list)
            for p in m["content"] if p["type"] != "text"]


def sharegpt_twin(conversation: list[dict]) -> dict:
    """The LLaVA-style ShareGPT record of an OpenAI image conversation."""
    speaker = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in image_texts(conversation)],
            "image": image_paths(conversation)}


def build_vlm_chat_input(folder: Path, copies: int = 1) -> tuple[Path, Path]:
    """(tokenizer folder with IMAGE_TOKEN, chat manifest) with two small images under ``folder/in/img``; the
    manifest holds IMAGE_CONVERSATIONS (OpenAI shape) then their ShareGPT twins, ``copies`` times."""
    from PIL import Image
    from tokenizers import Tokenizer

    tok_dir = build_chat_tokenizer(folder / "tok")
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.add_special_tokens([IMAGE_TOKEN])
    tok.save(str(tok_dir / "tokenizer.json"))
    img = folder / "in" / "img"
    img.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (24, 20), (220, 30, 20)).save(img / "red.png")
    Image.new("RGB", (18, 30), (20, 40, 230)).save(img / "blue.jpg", quality=90)
    records = [{"messages": c} for c in IMAGE_CONVERSATIONS] + [sharegpt_twin(c) for c in IMAGE_CONVERSATIONS]
    records *= copies
    manifest = folder / "in" / "chat.jsonl"
    manifest.write_text("".join(json.dumps({**r, "id": f"chat-{i}"}) + "\n" for i, r in enumerate(records)))
    return tok_dir, manifest


def ids_with_plain_contents(hf, messages: list[dict], template: str | None = None, **kw) -> list[int]:
    """transformers' ids (``hf``: its tokenizer) of what ``template`` (None: its own) writes around the messages'
    contents, and the contents as plain text (``split_special_tokens``): what 'message text is text' gives."""
    marks = [f"\u2063{i}\u2063" for i in range(len(messages))]
    extra = {} if template is None else {"chat_template": template}
    rendered = hf.apply_chat_template([{**m, "content": k} for m, k in zip(messages, marks)], tokenize=False,
                                      **extra, **kw)
    ids = []
    for mark, m in zip(marks, messages):
        before, rendered = rendered.split(mark)
        ids += hf(before, add_special_tokens=False)["input_ids"]
        ids += hf(m["content"], add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids + hf(rendered, add_special_tokens=False)["input_ids"]
