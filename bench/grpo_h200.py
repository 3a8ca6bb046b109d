"""GRPO speed, one JSON line per run: mmtrain (``python -m mmtrain.pretrain_gpt`` with ``train.objective=grpo``, the
product's own entry point) or TRL's ``GRPOTrainer`` on the same model shape, tokenizer, prompts and batch.

    python bench/grpo_h200.py mmtrain --model configs/models/llama3.2-1b.yaml --tokenizer .device/data/sp.model
    python bench/grpo_h200.py trl     --model configs/models/llama3.2-1b.yaml --tokenizer .device/data/sp.model

Task: the arithmetic sample prompts (``dataprep.samples``, task "arithmetic") scored by
``mmtrain.rewards:arithmetic_exact_match``. Both models start from a random init (a throughput figure: no reward
is learnt, so completions run to ``--max-new`` tokens unless the end-of-document token is drawn), bf16, no
activation recompute, sampling at temperature 1, beta 0 (no reference), TRL's default loss (dapo). A step
completes ``--prompts`` prompts ``--group`` times in one generation and trains on them in micro-batches of
``--micro`` prompts (TRL: ``per_device_train_batch_size`` = micro x group, gradient accumulation over the step).

Reported (median over the steps after ``--warmup``): ``step_s``, ``generation_s`` (mmtrain: its metric;
TRL: the time in ``GRPOTrainer._generate``, synchronized), ``train_s`` (the rest of the step), ``rollouts_per_s``
(completions per second of step), ``completion_tokens`` (mean per completion), ``peak_mem_gib``; mmtrain also
the timed steps' ``rollout_errors`` and ``reward_errors`` (summed) and each timed step's own times (``per_step``).

TRL needs ``trl``, ``accelerate`` and (imported by TRL) ``datasets`` and ``pandas``; ``--shim-datasets`` puts
stand-ins for the last two in their place (for a machine without them: pyarrow, which datasets needs, is too large
to carry to the device; the run uses neither), and for pyarrow itself when it does not import (trl.data_utils
imports it): the prompts are then a list-backed dataset the trainer indexes.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engine", choices=["mmtrain", "trl"])
    p.add_argument("--model", default=str(REPO / "configs/models/llama3.2-1b.yaml"))
    p.add_argument("--tokenizer", required=True, help="SentencePiece .model or tokenizer.json")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--micro", type=int, default=4, help="prompts per micro-batch")
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cuda")
    p.add_argument("--work", default="", help="folder for the prompts and runs (default: a temporary one)")
    p.add_argument("--shim-datasets", action="store_true", help="TRL: stand-in datasets/pandas modules (see above)")
    p.add_argument("overrides", nargs="*", help="mmtrain: more key=value overrides (a tiny shape for a CPU check)")
    return p.parse_args()


def _prompts_file(work: Path, count: int) -> Path:
    from dataprep.samples import write_sample_prompts

    return write_sample_prompts(work / "arith.jsonl", count, seed=0, task="arithmetic")


def _median(rows: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in rows), 4)


def run_mmtrain(a: argparse.Namespace, work: Path) -> dict:
    """The run through ``python -m mmtrain.pretrain_gpt``; the figures from its metrics.jsonl."""
    prompts = _prompts_file(work, a.prompts * (a.steps + a.warmup))
    run_dir = work / "mmtrain_run"
    precision = "bf16" if a.device == "cuda" else "fp32"
    cmd = [sys.executable, "-m", "mmtrain.pretrain_gpt", "--config", a.model, "train.objective=grpo",
           f"grpo.prompts={prompts}", f"grpo.tokenizer={a.tokenizer}",
           "grpo.reward=mmtrain.rewards:arithmetic_exact_match", f"grpo.group_size={a.group}",
           f"grpo.max_new_tokens={a.max_new}", f"data.seq_length={a.max_new + 32}",
           f"train.steps={a.steps + a.warmup}", f"train.micro_batch_size={a.micro}",
           f"train.global_batch_size={a.prompts}", f"train.precision={precision}", f"train.device={a.device}",
           "optim.lr=1e-6", "optim.warmup_steps=0", "checkpoint.save_final=false", "logging.log_every=1",
           f"logging.run_dir={run_dir}", *a.overrides]
    proc = subprocess.run(cmd, cwd=REPO, text=True, capture_output=True)
    if proc.returncode != 0:
        raise SystemExit(f"mmtrain run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][a.warmup:]
    return {"engine": "mmtrain", "step_s": _median(rows, "step_time_s"), "generation_s": _median(rows, "generation_s"),
            "train_s": _median(rows, "train_s"), "rollouts_per_s": _median(rows, "rollouts_per_s"),
            "completion_tokens": _median(rows, "completion_length"),
            "peak_mem_gib": round(max(r.get("mem_gib", 0.0) for r in rows), 1),
            "rollout_errors": sum(r["rollout_errors"] for r in rows),
            "reward_errors": sum(r["reward_errors"] for r in rows),
            "per_step": [{k: round(r[k], 4) for k in ("step_time_s", "generation_s", "train_s", "completion_length")}
                         for r in rows]}


class _ListDataset:
    """The shim's ``datasets.Dataset``: the rows of a list, indexed (what the trainer's sampler and loader use)."""

    cache_files: list = []  # in memory (what TRL's start-up reads of a dataset)

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def _install_shims() -> None:
    """Stand-in ``datasets`` / ``pandas`` modules (TRL imports names from them; the run uses neither), and
    ``pyarrow`` when it does not import (trl.data_utils imports it at the top and names its types in annotations;
    only dataset packing calls it, which this run does not use)."""
    for name in ("datasets", "pandas"):
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # torch._dynamo looks modules up by spec
        for cls in ("DatasetDict", "IterableDataset", "IterableDatasetDict", "DataFrame"):
            setattr(module, cls, type(cls, (), {}))
        module.Dataset = _ListDataset
        sys.modules[name] = module
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        def stand_in(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)
            return type(attr, (), {})

        for name in ("pyarrow", "pyarrow.compute", "pyarrow.types"):
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
            module.__getattr__ = stand_in  # any name TRL reads at import (pa.Table, pa.Array, ...): an empty class
            sys.modules[name] = module
        sys.modules["pyarrow"].compute = sys.modules["pyarrow.compute"]
        sys.modules["pyarrow"].types = sys.modules["pyarrow.types"]


def _dataset(rows: list[dict]):
    import datasets

    return datasets.Dataset(rows) if datasets.Dataset is _ListDataset else datasets.Dataset.from_list(rows)


def _hf_tokenizer(path: str, folder: Path):
    """The HF fast tokenizer of ``path`` as ``mmtrain-to-hf`` exports it (same ids as mmtrain's)."""
    from transformers import PreTrainedTokenizerFast

    from mmtrain.convert.hf_tokenizer import hf_tokenizer_files, open_tokenizer

    files, _ = hf_tokenizer_files(open_tokenizer(path))
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def run_trl(a: argparse.Namespace, work: Path) -> dict:
    """TRL's GRPOTrainer on transformers' model of the same shape; step and generation times measured here."""
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing fetched, and no telemetry ping from TRL's trainer
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    if a.shim_datasets:
        _install_shims()
    from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from mmtrain.config import GPTRunConfig, load_config
    from mmtrain.models.registry import model_family
    from mmtrain.rewards import arithmetic_exact_match

    cfg = load_config(GPTRunConfig, a.model, a.overrides)
    fields = dict(model_family(cfg.model).hf.config_to_hf(cfg.model, None))
    hf_config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    cuda = a.device == "cuda"
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16 if cuda else torch.float32,
                                             attn_implementation="sdpa")
    tokenizer = _hf_tokenizer(a.tokenizer, work / "hf_tok")
    rows = [json.loads(line) for line in _prompts_file(work, a.prompts * (a.steps + a.warmup)).read_text().splitlines()]

    def reward(prompts, completions, answer, **kwargs):
        return [arithmetic_exact_match(p, c, x) for p, c, x in zip(prompts, completions, answer)]

    args = GRPOConfig(output_dir=str(work / "trl_run"), per_device_train_batch_size=a.micro * a.group,
                      gradient_accumulation_steps=a.prompts // a.micro, num_generations=a.group,
                      max_completion_length=a.max_new, max_steps=a.steps + a.warmup, learning_rate=1e-6,
                      temperature=1.0, top_p=1.0, beta=0.0, gradient_checkpointing=False, bf16=cuda,
                      use_cpu=not cuda, logging_steps=1, report_to="none", save_strategy="no", seed=0,
                      disable_tqdm=True)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=_dataset(rows),
                          processing_class=tokenizer)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    generation: list[float] = []
    generate = trainer._generate

    def timed_generate(*args, **kwargs):
        sync()
        t0 = time.perf_counter()
        out = generate(*args, **kwargs)
        sync()
        generation.append(time.perf_counter() - t0)
        return out
    trainer._generate = timed_generate
    steps: list[dict] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.t0, self.generated = time.perf_counter(), len(generation)

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            dt = time.perf_counter() - self.t0
            gen = sum(generation[self.generated:])
            steps.append({"step_time_s": dt, "generation_s": gen, "train_s": dt - gen,
                          "rollouts_per_s": a.prompts * a.group / dt})
    trainer.add_callback(StepTimes())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    if len(steps) != a.steps + a.warmup:  # one begin/end pair per optimizer step, as the figures assume
        raise SystemExit(f"TRL ran {len(steps)} timed steps, expected {a.steps + a.warmup}")
    timed = steps[a.warmup:]
    return {"engine": "trl", "step_s": _median(timed, "step_time_s"), "generation_s": _median(timed, "generation_s"),
            "train_s": _median(timed, "train_s"), "rollouts_per_s": _median(timed, "rollouts_per_s"),
            "completion_tokens": round(statistics.median(lengths[a.warmup:] or [0.0]), 1),
            "peak_mem_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1) if cuda else 0.0}


def main() -> None:
    a = _args()
    with tempfile.TemporaryDirectory(prefix="grpo_bench_") as tmp:
        work = Path(a.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = (run_mmtrain if a.engine == "mmtrain" else run_trl)(a, work)
    print(json.dumps({**result, "prompts": a.prompts, "group": a.group, "max_new": a.max_new}), flush=True)


if __name__ == "__main__":
    main()
