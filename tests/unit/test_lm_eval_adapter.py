"""The lm-evaluation-harness model ``mmtrain``: on local tasks (multiple choice, rolling loglikelihood, greedy
generation) its scores equal lm-eval's own ``hf`` model on the same weights exported with mmtrain-to-hf, with
the same defaults (context length, device) from the command line; a tokenizer other than the checkpoint's is
refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

import lm_eval  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

import mmtrain.lm_eval as cli  # noqa: E402 - registers the "mmtrain" model
import mmtrain.lm_eval_model as adapter  # noqa: E402
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


# shorter than the rolling task's texts: a context limit taken from the training run would cut them into windows
TRAINED_SEQ_LENGTH = 8


def _record_training(ckpt: Path, seq_length: int, tokenizer: dict) -> None:
    """Make the converted checkpoint's complete.json look as a training run's would: its data.seq_length and
    the tokenizer its data's manifests named."""
    meta_path = ckpt / "step_00000000" / "complete.json"
    meta = json.loads(meta_path.read_text())
    meta["config"]["data"]["seq_length"] = seq_length
    meta["tokenizer"] = tokenizer
    meta_path.write_text(json.dumps(meta))
    from mmtrain.utils.checkpoint_marker import reseal_checkpoint

    reseal_checkpoint(meta_path.parent)  # an edit on purpose: sealed again (rehash), else loading refuses it


@pytest.fixture(scope="module")
def setup(tmp_path_factory, request):
    tmp = tmp_path_factory.mktemp("lmeval")
    spm = train_sentencepiece(tmp / "tok") if request.param == "sentencepiece" else build_hf_bpe(tmp / "tok")
    ckpt, _ = write_checkpoint_for(tmp / "ckpt", load_tokenizer(spm).vocab_size)
    _record_training(ckpt, seq_length=TRAINED_SEQ_LENGTH, tokenizer=load_tokenizer(spm).describe())
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


@pytest.mark.parametrize("setup", ["sentencepiece", "tokenizer.json"], indirect=True)
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


def _run_cli(main, argv: list[str], out: Path) -> tuple[dict, dict]:
    """(results, {task: per-request log-likelihoods by doc}) of one lm-eval command line run into ``out``."""
    assert main([*argv, "--output_path", str(out), "--log_samples"]) in (0, None)
    [results] = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    values = {}
    for task in ("tiny_mc", "tiny_rolling"):
        [samples] = list(out.rglob(f"samples_{task}_*.jsonl"))
        rows = sorted((json.loads(line) for line in samples.read_text().splitlines()), key=lambda r: r["doc_id"])
        values[task] = [float(x[0] if isinstance(x, list) else x) for r in rows for x in r["filtered_resps"]]
    return results["results"], values


@pytest.mark.parametrize("setup", ["sentencepiece"], indirect=True)
def test_the_command_line_defaults_equal_lm_eval_hf_on_the_export(setup, monkeypatch, tmp_path):
    """``python -m mmtrain.lm_eval --model mmtrain`` and ``lm_eval --model hf`` on the export, both with their
    defaults: no --device on a machine without CUDA (lm-eval's default is cuda:0) and no max_length, on texts
    longer than the training sequence. The same log-likelihoods to 1e-5."""
    import torch
    from lm_eval.__main__ import cli_evaluate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # the command line indexes lm-eval's thousands of built-in tasks first; these tests need only the local ones
    manager = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda *a, **k: manager(*a, **{**k, "include_defaults": False}))
    _, ckpt, spm, hf, tasks = setup
    common = ["--tasks", "tiny_mc,tiny_rolling", "--include_path", str(tasks), "--batch_size", "2"]
    ours = _run_cli(cli.main, ["--model", "mmtrain", "--model_args", f"ckpt={ckpt}", *common], tmp_path / "ours")

    def lm_eval_main(argv):
        monkeypatch.setattr("sys.argv", ["lm_eval", *argv])
        cli_evaluate()

    theirs = _run_cli(lm_eval_main, ["--model", "hf", "--model_args", f"pretrained={hf},dtype=float32", *common],
                      tmp_path / "hf")
    for task in ("tiny_mc", "tiny_rolling"):
        assert ours[1][task] == pytest.approx(theirs[1][task], rel=1e-5), task
        for metric, value in theirs[0][task].items():
            if isinstance(value, float) and not metric.endswith("_stderr,none"):
                assert ours[0][task][metric] == pytest.approx(value, rel=1e-5), (task, metric)


def test_help_names_the_model_arguments(capsys):
    assert cli.main(["--help"]) == 0
    text = capsys.readouterr().out
    for key in ("ckpt=PATH", "tokenizer=PATH", "max_length=N", "allow_other_tokenizer=true", "--device"):
        assert key in text


@pytest.mark.parametrize("setup", ["tokenizer.json"], indirect=True)
def test_a_tokenizer_other_than_the_checkpoints_is_refused(setup, tmp_path):
    _, ckpt, spm, _, _ = setup
    other = train_sentencepiece(tmp_path / "other")
    adapter.MMTrainLM(ckpt=str(ckpt), tokenizer=str(spm))  # the one the checkpoint names
    refused = r"tokenizer=.*sp\.model is sentencepiece .* but .* trained with huggingface .*allow_other_tokenizer=true"
    with pytest.raises(adapter.MMTrainLMError, match=refused):
        adapter.MMTrainLM(ckpt=str(ckpt), tokenizer=str(other))
    adapter.MMTrainLM(ckpt=str(ckpt), tokenizer=str(other), allow_other_tokenizer="true")


def test_a_cuda_device_without_cuda_is_one_line(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert adapter._device(None).type == "cpu"
    with pytest.raises(adapter.MMTrainLMError, match="device=cuda:0 but no CUDA device is visible; pass --device cpu"):
        adapter._device("cuda:0")


@pytest.mark.parametrize("setup", ["tokenizer.json"], indirect=True)
def test_the_greedy_loop_stops_at_a_stop_id(setup):
    import torch

    tmp, ckpt, _, _, _ = setup
    model, _, _ = adapter.load_model(ckpt, torch.device("cpu"), torch.float32)
    [free] = adapter._greedy_generate(model, [[5, 6, 7]], 6, set())
    assert len(free) == 6
    [stopped] = adapter._greedy_generate(model, [[5, 6, 7]], 6, {free[2]})
    assert stopped == free[:free.index(free[2])]
