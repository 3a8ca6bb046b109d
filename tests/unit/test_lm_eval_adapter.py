"""The lm-evaluation-harness model ``mmtrain``: on local tasks (multiple choice, rolling loglikelihood, greedy
generation) its scores equal lm-eval's own ``hf`` model on the same weights exported with mmtrain-to-hf."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import mmtrain.lm_eval as adapter  # noqa: E402 - registers the "mmtrain" model
from mmtrain.convert.__main__ import main as convert_main  # noqa: E402
from mmtrain.core.tokenizer import load_tokenizer  # noqa: E402
from tests.eval_helpers import train_sentencepiece, write_checkpoint_for  # noqa: E402
from tests.unit.test_tokenizer import build_hf_bpe  # noqa: E402

pytestmark = pytest.mark.unit

DOCS = [
    {"question": "The quick brown", "choices": [" fox", " dog", " cat"], "answer": 0,
     "text": "The quick brown fox jumps over the lazy dog.", "target": "jumps"},
    {"question": "Numbers 1234", "choices": ["567890", " and", " code"], "answer": 0,
     "text": "Tabs\tand\nnewlines and    spaces.", "target": "and"},
    {"question": "Café, naïve,", "choices": [" résumé", " Москва", " 東京"], "answer": 1,
     "text": "Emoji: 🙂 👍🏽 and symbols ∑ ∫ ≠ ≤.", "target": "x"},
]

TASKS = {
    "tiny_mc": """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files: {test: DATA}
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - metric: acc
""",
    "tiny_rolling": """task: tiny_rolling
dataset_path: json
dataset_kwargs:
  data_files: {test: DATA}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
""",
    "tiny_gen": """task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files: {test: DATA}
test_split: test
output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{target}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
""",
}


@pytest.fixture(scope="module", params=["sentencepiece", "tokenizer.json"])
def setup(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("lmeval")
    spm = train_sentencepiece(tmp / "tok") if request.param == "sentencepiece" else build_hf_bpe(tmp / "tok")
    ckpt, _ = write_checkpoint_for(tmp / "ckpt", load_tokenizer(spm).vocab_size)
    hf = tmp / "hf"
    assert convert_main(["mmtrain-to-hf", "--ckpt", str(ckpt), "--out", str(hf), "--tokenizer", str(spm)]) == 0
    data = tmp / "docs.jsonl"
    data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in DOCS), encoding="utf-8")
    tasks = tmp / "tasks"
    tasks.mkdir()
    for name, text in TASKS.items():
        (tasks / f"{name}.yaml").write_text(text.replace("DATA", str(data)))
    return tmp, ckpt, spm, hf, tasks


def _evaluate(model: str, model_args: str, tasks: Path) -> dict:
    # only the local tasks: indexing lm-eval's thousands of built-in task files costs most of a run
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS), device="cpu",
                                   batch_size=2, task_manager=manager, log_samples=True)


def _resps(result: dict, task: str) -> list:
    return [s["filtered_resps"] for s in sorted(result["samples"][task], key=lambda s: s["doc_id"])]


def test_scores_equal_the_hf_model_on_the_exported_weights(setup, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tmp, ckpt, spm, hf, tasks = setup
    ours = _evaluate("mmtrain", f"ckpt={ckpt},tokenizer={spm}", tasks)
    theirs = _evaluate("hf", f"pretrained={hf},dtype=float32", tasks)
    for task in TASKS:
        mine, ref = ours["results"][task], theirs["results"][task]
        for metric, value in ref.items():
            if isinstance(value, float) and not metric.endswith("_stderr,none"):
                assert mine[metric] == pytest.approx(value, rel=1e-4, abs=1e-6), (task, metric)
    for task in ("tiny_mc", "tiny_rolling"):  # every log-likelihood, not only the aggregate
        for a, b in zip(_resps(ours, task), _resps(theirs, task)):
            flat_a = [x[0] if isinstance(x, (list, tuple)) else x for x in a]
            flat_b = [x[0] if isinstance(x, (list, tuple)) else x for x in b]
            assert [float(x) for x in flat_a] == pytest.approx([float(x) for x in flat_b], rel=1e-4)
    # a random model emits stray byte-fallback pieces, whose invalid UTF-8 SentencePiece and tokenizers decode
    # differently: generated text is compared with the tokenizer.json tokenizer (one library on both sides)
    if spm.suffix != ".model":
        assert _resps(ours, "tiny_gen") == _resps(theirs, "tiny_gen")
    assert any(r[0][0] for r in _resps(ours, "tiny_gen")), "the greedy continuations are all empty"


@pytest.mark.parametrize("setup", ["tokenizer.json"], indirect=True)
def test_the_command_line_runs_lm_eval_with_the_model_registered(setup, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    _, ckpt, spm, _, tasks = setup
    out = tmp_path / "out"
    adapter.main(["--model", "mmtrain", "--model_args", f"ckpt={ckpt},tokenizer={spm}", "--tasks", "tiny_mc",
                  "--include_path", str(tasks), "--device", "cpu", "--output_path", str(out)])
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert results and "acc,none" in results[0]["results"]["tiny_mc"]


@pytest.mark.parametrize("setup", ["tokenizer.json"], indirect=True)
def test_the_greedy_loop_stops_at_a_stop_id(setup):
    import torch

    tmp, ckpt, _, _, _ = setup
    model, _, _ = adapter.load_model(ckpt, torch.device("cpu"), torch.float32)
    [free] = adapter._greedy_generate(model, [[5, 6, 7]], 6, set())
    assert len(free) == 6
    [stopped] = adapter._greedy_generate(model, [[5, 6, 7]], 6, {free[2]})
    assert stopped == free[:free.index(free[2])]
