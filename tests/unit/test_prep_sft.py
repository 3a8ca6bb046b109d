"""`mmtrain-prep sft`: chat-template tokens and loss masks equal transformers' ``apply_chat_template`` (ids and
``return_assistant_tokens_mask``) on the same tokenizer file, for each built-in template and a tokenizer's own
template; preference pairs; rejects; inspect / verify."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dataprep.cli import main as prep
from mmtrain.core.chat_template import BUILTIN_TEMPLATES
from mmtrain.core.indexed import IndexedDataset
from tests.sft_helpers import CONVERSATIONS, OWN_TEMPLATE_TAGGED, build_chat_tokenizer

@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory) -> Path:
    return build_chat_tokenizer(tmp_path_factory.mktemp("chat_tok"))


def _hf(chat_tok):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(chat_tok / "tokenizer.json"), bos_token="<s>", eos_token="</s>")


def _write(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def _load(prefix) -> list[tuple[list[int], list[int]]]:
    tokens, masks = IndexedDataset(prefix), IndexedDataset(f"{prefix}_loss_mask")
    assert len(tokens) == len(masks)
    return [(tokens[i].tolist(), masks[i].tolist()) for i in range(len(tokens))]


@pytest.mark.parametrize("template", ["chatml", "llama3", "tokenizer"])
def test_loss_mask_equals_transformers(tmp_path, chat_tok, template):
    """Golden: ids and assistant-token mask equal transformers' apply_chat_template on the same tokenizer."""
    records = [{"messages": c} for c in CONVERSATIONS]
    # the same conversations in ShareGPT form must give the same tokens
    records += [{"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                    "value": m["content"]} for m in c]} for c in CONVERSATIONS]
    prefix = tmp_path / "sft"
    assert prep(["sft", "--input", str(_write(tmp_path / "in.jsonl", records)), "--output-prefix", str(prefix),
                 "--tokenizer", str(chat_tok), "--chat-template", template, "--workers", "0"]) == 0
    got = _load(prefix)
    hf = _hf(chat_tok)
    reference_template = OWN_TEMPLATE_TAGGED if template == "tokenizer" else BUILTIN_TEMPLATES[template]
    for i, conv in enumerate(CONVERSATIONS + CONVERSATIONS):
        ref = hf.apply_chat_template(conv, chat_template=reference_template, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert got[i][0] == list(ref["input_ids"]), (template, i)
        assert got[i][1] == list(ref["assistant_masks"]), (template, i)
        assert sum(got[i][1]) > 0
    manifest = json.loads(Path(f"{prefix}.manifest.json").read_text())
    assert manifest["command"] == "mmtrain-prep sft" and manifest["loss_masks"] == {"tokens": "loss_mask"}
    assert manifest["loss_tokens"]["tokens"] == sum(sum(m) for _, m in got)


def test_loss_mask_marks_exactly_the_assistant_text(tmp_path, chat_tok):
    """Decoding the loss tokens gives back each assistant message and its end-of-turn token, nothing else."""
    prefix = tmp_path / "sft"
    assert prep(["sft", "--input", str(_write(tmp_path / "in.jsonl", [{"messages": CONVERSATIONS[1]}])),
                 "--output-prefix", str(prefix), "--tokenizer", str(chat_tok), "--chat-template", "chatml",
                 "--workers", "0"]) == 0
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(chat_tok / "tokenizer.json"))
    (ids, mask), = _load(prefix)
    runs, current = [], []
    for t, m in zip(ids + [None], mask + [0]):
        if m:
            current.append(t)
        elif current:
            runs.append(tok.decode(current, skip_special_tokens=False))
            current = []
    assert runs == ["4<|im_end|>", " 6, of course.\n<|im_end|>"]


def test_prompt_completion_and_plain_text(tmp_path, chat_tok):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(chat_tok / "tokenizer.json"))
    src = _write(tmp_path / "pc.jsonl", [{"prompt": "Q: 2+2?\nA:", "completion": " 4"}])
    prefix = tmp_path / "pc"
    assert prep(["sft", "--input", str(src), "--output-prefix", str(prefix), "--tokenizer", str(chat_tok),
                 "--chat-template", "none", "--append-eod", "--workers", "0"]) == 0
    (ids, mask), = _load(prefix)
    assert ids == tok.encode("Q: 2+2?\nA: 4").ids + [tok.token_to_id("</s>")]
    loss = [t for t, m in zip(ids, mask) if m]
    assert tok.decode(loss, skip_special_tokens=False) == " 4</s>"
    prefix_all = tmp_path / "pc_all"
    assert prep(["sft", "--input", str(src), "--output-prefix", str(prefix_all), "--tokenizer", str(chat_tok),
                 "--chat-template", "chatml", "--loss-on", "all", "--workers", "0"]) == 0
    (_, mask_all), = _load(prefix_all)
    assert set(mask_all) == {1}


def test_preference_pairs(tmp_path, chat_tok):
    records = [{"prompt": "Hi there", "chosen": "Hello!", "rejected": "Go away."},
               {"chosen": CONVERSATIONS[1], "rejected": CONVERSATIONS[1][:3] + [{"role": "assistant",
                                                                                 "content": "7"}]}]
    prefix = tmp_path / "pref"
    assert prep(["sft", "--preference", "--input", str(_write(tmp_path / "p.jsonl", records)), "--output-prefix",
                 str(prefix), "--tokenizer", str(chat_tok), "--chat-template", "chatml", "--workers", "0"]) == 0
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(chat_tok / "tokenizer.json"))

    def loss_text(name, i):
        ids, mask = IndexedDataset(f"{prefix}_{name}")[i], IndexedDataset(f"{prefix}_{name}_loss_mask")[i]
        return tok.decode([int(t) for t, m in zip(ids, mask) if m], skip_special_tokens=False)

    assert loss_text("chosen", 0) == "Hello!<|im_end|>" and loss_text("rejected", 0) == "Go away.<|im_end|>"
    # whole conversations: only the answers after the shared prompt carry the loss, not the earlier "4"
    assert loss_text("chosen", 1) == " 6, of course.\n<|im_end|>" and loss_text("rejected", 1) == "7<|im_end|>"
    assert prep(["verify", str(prefix)]) == 0


def test_weight_0_assistant_messages_carry_no_loss(tmp_path, chat_tok):
    """OpenAI's fine-tuning format: an assistant message with "weight": 0 is context only -- the same tokens, no
    loss on it; 1 is the default; other values, or a weight on another role, are rejects naming the message."""
    weighted = [dict(m) for m in CONVERSATIONS[1]]
    weighted[1]["weight"], weighted[3]["weight"] = 0, 1
    all_zero = [{**m, "weight": 0} if m["role"] == "assistant" else m for m in CONVERSATIONS[1]]
    records = [{"messages": CONVERSATIONS[1]}, {"messages": weighted},
               {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "no", "weight": 0},
                                  {"from": "human", "value": "again"}, {"from": "gpt", "value": "yes"}]},
               {"messages": all_zero},
               {"messages": [{**CONVERSATIONS[1][0], "weight": 0}, *CONVERSATIONS[1][1:]]},
               {"messages": [CONVERSATIONS[1][0], {**CONVERSATIONS[1][1], "weight": 0.5}]},
               {"messages": [CONVERSATIONS[1][0], {**CONVERSATIONS[1][1], "weight": True}]},
               {"chosen": weighted, "rejected": CONVERSATIONS[1][:2]}]
    prefix = tmp_path / "sft"
    assert prep(["sft", "--input", str(_write(tmp_path / "in.jsonl", records[:-1])), "--output-prefix", str(prefix),
                 "--tokenizer", str(chat_tok), "--chat-template", "chatml", "--workers", "0"]) == 0
    (tokens, mask), (w_tokens, w_mask), (s_tokens, s_mask) = _load(prefix)
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(chat_tok / "tokenizer.json"))
    assert w_tokens == tokens
    assert tk.decode([t for t, m in zip(tokens, mask) if m], skip_special_tokens=False) == \
        "4<|im_end|> 6, of course.\n<|im_end|>"
    assert tk.decode([t for t, m in zip(w_tokens, w_mask) if m], skip_special_tokens=False) == \
        " 6, of course.\n<|im_end|>"
    assert tk.decode([t for t, m in zip(s_tokens, s_mask) if m], skip_special_tokens=False) == "yes<|im_end|>"
    rejects = [json.loads(x) for x in Path(f"{prefix}.rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["code"]) for r in rejects] == [(4, "no_assistant_turn"), (5, "bad_weight"),
                                                         (6, "bad_weight"), (7, "bad_weight")]
    assert "weight 0 ones are not trained" in rejects[0]["reason"]
    assert "messages[0].weight is set on a user message" in rejects[1]["reason"]
    assert "messages[1].weight is 0.5; weight is 0" in rejects[2]["reason"]
    pairs = tmp_path / "pref"
    assert prep(["sft", "--preference", "--input", str(_write(tmp_path / "pref.jsonl", records[-1:])),
                 "--output-prefix", str(pairs), "--tokenizer", str(chat_tok), "--chat-template", "chatml",
                 "--workers", "0"]) == 0
    chosen, chosen_mask = (IndexedDataset(f"{pairs}_{k}")[0].tolist() for k in ("chosen", "chosen_loss_mask"))
    assert tk.decode([t for t, m in zip(chosen, chosen_mask) if m], skip_special_tokens=False) == \
        " 6, of course.\n<|im_end|>"


def test_identical_chosen_and_rejected_are_counted_and_warned(tmp_path, chat_tok, capsys):
    records = [{"prompt": "Hi there", "chosen": "Hello!", "rejected": "Go away."},
               {"prompt": "Hi there", "chosen": "Same.", "rejected": "Same."},
               {"prompt": CONVERSATIONS[1][:3], "chosen": CONVERSATIONS[1][3:], "rejected": CONVERSATIONS[1][3:]},
               {"prompt": "Hi", "chosen": "Same.", "rejected": "Other."}]
    prefix = tmp_path / "pref"
    assert prep(["sft", "--preference", "--input", str(_write(tmp_path / "p.jsonl", records)), "--output-prefix",
                 str(prefix), "--tokenizer", str(chat_tok), "--chat-template", "chatml", "--workers", "0"]) == 0
    m = json.loads(Path(f"{prefix}.manifest.json").read_text())
    assert m["documents"]["written"] == 4 and m["documents"]["rejected"] == 0  # written, not rejected
    assert m["warnings_by_code"] == {"identical_pair": 2}
    warned = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warned) == 1 and "2 identical_pair record(s)" in warned[0] and "p.jsonl:2:" in warned[0]
    assert "zero-gradient" in warned[0]


def test_rejects_and_verify_inspect(tmp_path, chat_tok, capsys):
    lines = [json.dumps({"messages": CONVERSATIONS[0]}),
             json.dumps({"messages": [{"role": "tool", "content": "x"}]}),
             json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
             json.dumps({"conversations": [{"from": "human", "value": 3}]}),
             json.dumps({"text": "no chat here"}),
             "{broken",
             json.dumps({"messages": [{"role": "user", "content": "\ufdd0"}, {"role": "assistant", "content": "x"}]}),
             json.dumps({"messages": CONVERSATIONS[1]})]
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(lines) + "\n")
    prefix = tmp_path / "sft"
    assert prep(["sft", "--input", str(src), "--output-prefix", str(prefix), "--tokenizer", str(chat_tok),
                 "--chat-template", "chatml", "--workers", "0"]) == 0
    rejects = [json.loads(x) for x in Path(f"{prefix}.rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["code"]) for r in rejects] == [
        (2, "bad_role"), (3, "no_assistant_turn"), (4, "not_a_string"), (5, "missing_key"), (6, "malformed_json"),
        (7, "template_error")]
    assert "messages[0].role is 'tool'" in rejects[0]["reason"]
    assert len(_load(prefix)) == 2
    # worker processes and many small blocks give the same bytes
    pooled = tmp_path / "pooled"
    assert prep(["sft", "--input", str(src), "--output-prefix", str(pooled), "--tokenizer", str(chat_tok),
                 "--chat-template", "chatml", "--workers", "2", "--block-mb", "0.0001"]) == 0
    for suffix in (".bin", ".idx", "_loss_mask.bin", "_loss_mask.idx", ".rejects.jsonl"):
        assert Path(f"{pooled}{suffix}").read_bytes() == Path(f"{prefix}{suffix}").read_bytes(), suffix
    capsys.readouterr()
    assert prep(["verify", str(prefix)]) == 0
    out = capsys.readouterr().out
    assert out.count("OK ") == 2
    assert prep(["inspect", str(prefix), "--doc", "0"]) == 0
    out = capsys.readouterr().out
    assert "LOSS 'Hello! How can I help?<|im_end|>'" in out
    assert "---- '<|im_start|>system\\nYou are terse.<|im_end|>" in out
    # a mask that no longer pairs with its tokens is a problem verify names
    mask_bin = Path(f"{prefix}_loss_mask.bin")
    data = bytearray(mask_bin.read_bytes())
    data[0] = 7
    mask_bin.write_bytes(bytes(data))
    assert prep(["verify", str(prefix), "--no-checksums"]) == 1
    assert "values other than 0 and 1" in capsys.readouterr().out


def test_bad_options_are_one_line_errors(tmp_path, chat_tok, capsys):
    src = _write(tmp_path / "in.jsonl", [{"messages": CONVERSATIONS[0]}])
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_bytes((chat_tok / "tokenizer.json").read_bytes())
    cases = [
        (["--tokenizer", str(bare)], "has no chat template"),
        (["--tokenizer", str(chat_tok), "--chat-template", "nosuch"], "neither a built-in"),
        (["--tokenizer", str(chat_tok), "--chat-template", str(_bad_template(tmp_path))], "Jinja syntax error"),
    ]
    for extra, message in cases:
        assert prep(["sft", "--input", str(src), "--output-prefix", str(tmp_path / "o"), "--workers", "0",
                     *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and err.count("\n") == 1, err
    assert not list(tmp_path.glob("o*"))


def _bad_template(tmp_path) -> Path:
    path = tmp_path / "bad.jinja"
    path.write_text("{% for m in messages %}{{ m['content'] }")
    return path


def test_hostile_template_is_sandboxed(tmp_path, chat_tok, capsys):
    """A template reaching for Python internals is refused by the sandbox: a one-line error, nothing written."""
    template = tmp_path / "evil.jinja"
    template.write_text("{{ messages.__class__.__mro__[1].__subclasses__() }}{% for m in messages %}"
                        "{{ m['content'] }}{% endfor %}")
    src = _write(tmp_path / "in.jsonl", [{"messages": CONVERSATIONS[0]}])
    assert prep(["sft", "--input", str(src), "--output-prefix", str(tmp_path / "o"), "--workers", "0",
                 "--tokenizer", str(chat_tok), "--chat-template", str(template)]) == 2
    err = capsys.readouterr().err
    assert "refused by the sandbox" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not list(tmp_path.glob("o*"))
