"""lm-evaluation-harness with mmtrain's model ``mmtrain`` registered (extra ``mmtrain[eval]``).

    python -m mmtrain.lm_eval --model mmtrain --model_args ckpt=CKPT,tokenizer=TOK --tasks hellaswag
    python -m mmtrain.lm_eval run --model mmtrain --model_args ckpt=CKPT --tasks my_task --include_path tasks/

lm-eval finds models only in its own registry (no plugin discovery), so ``python -m mmtrain.lm_eval`` registers
the model (``mmtrain.lm_eval_model.MMTrainLM``, by name) and then runs lm-eval's own command line with the same
arguments: every lm-eval option works. Two differences: ``--help`` (and no arguments) prints what the ``mmtrain``
model takes, at once (torch and lm-eval are imported only for a run), and a run without ``--device`` (or
``--config``) runs on the CPU when no CUDA device is visible (lm-eval's own default is ``cuda:0``). A bad model
argument, checkpoint or tokenizer is one line on stderr, exit status 2.
From Python, ``import mmtrain.lm_eval`` registers the model for ``lm_eval.simple_evaluate(model="mmtrain", ...)``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

PROG = "python -m mmtrain.lm_eval"
MODEL_TARGET = "mmtrain.lm_eval_model:MMTrainLM"

HELP = f"""usage: {PROG} [run] --model mmtrain --model_args ckpt=CKPT[,KEY=VALUE...] --tasks TASK[,TASK...]
       [lm-eval options]

lm-evaluation-harness (lm-eval) with the model `mmtrain` registered: scores an mmtrain checkpoint (any training
layout, one device) exactly as lm-eval's `hf` model scores its HF export. Every lm-eval option and command
works (--model hf, ls tasks, validate); lm-eval's own options: python -m lm_eval run --help.

--model_args of the mmtrain model (comma-separated KEY=VALUE):
  ckpt=PATH                  checkpoint step folder, or a checkpoints root with `latest` (required)
  tokenizer=PATH             SentencePiece .model, tokenizer.json (or its folder), GPT-2 vocab.json; default:
                             the tokenizer the checkpoint names (its data's, recorded at training)
  dtype=float32|bfloat16     default float32
  max_length=N               context limit; default max_position_embeddings as the HF export writes it (what
                             lm-eval's hf model uses on that export)
  prefix_token_id=N          token before a text with no context; default the tokenizer's BOS, else its EOD
  allow_other_tokenizer=true score with a tokenizer= that is not the checkpoint's (refused by default)

--device: default cuda when a CUDA device is visible, else cpu. --batch_size N (auto means 8).

examples:
  {PROG} --model mmtrain --model_args ckpt=runs/demo/train/checkpoints --tasks hellaswag,arc_easy \\
      --batch_size 8 --output_path results/
  {PROG} --model mmtrain --model_args ckpt=CKPT --tasks my_task --include_path my_tasks/

docs/evaluate.md has the details."""

_OTHER_COMMANDS = ("ls", "validate")


def register() -> None:
    """Register the model ``mmtrain`` in lm-eval's registry by name (lm-eval imports the class when it is used);
    once: the registry refuses a second registration after it has loaded the class."""
    try:
        import lm_eval.models  # noqa: F401 - lm-eval's own models first: its registry fills itself only when empty
        from lm_eval.api.registry import model_registry
    except ImportError:  # the optional extra is not installed
        raise ImportError("the lm-evaluation-harness adapter needs lm-eval: pip install 'mmtrain[eval]'") from None
    if "mmtrain" not in model_registry:
        model_registry.register("mmtrain", target=MODEL_TARGET)


def _wants_help(argv: list[str]) -> bool:
    return not argv or any(a in ("-h", "--help") for a in argv)


def _missing_checkpoint(args: Any) -> str | None:
    """What is wrong with the ``ckpt`` model argument of an ``mmtrain`` run, found without loading anything."""
    if getattr(args, "command", None) != "run" or args.model != "mmtrain":
        return None
    ckpt = args.model_args.get("ckpt") if isinstance(args.model_args, dict) else None  # lm-eval parses a dict
    if ckpt is None:
        return "--model mmtrain needs --model_args ckpt=PATH (a checkpoint step folder or checkpoints root)"
    if not Path(str(ckpt)).exists():
        return f"ckpt={ckpt}: not found (looked for {Path(str(ckpt)).resolve()})"
    return None


def _cpu_without_cuda(args: Any) -> None:
    """lm-eval's ``--device`` default (``cuda:0``) cannot run without CUDA: a run that names no device (neither
    ``--device`` nor a ``--config`` file, which may) gets the CPU there, as the ``mmtrain`` model's own default."""
    import torch

    if getattr(args, "command", None) == "run" and args.device is None and args.config is None \
            and not torch.cuda.is_available():
        args.device = "cpu"


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the ``mmtrain`` model registered (see the module docstring)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if _wants_help(argv):
        print(HELP)
        return 0
    register()
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    sys.argv = [PROG, *argv]  # lm-eval's parser reads sys.argv (and inserts `run` when no command is given)
    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    problem = _missing_checkpoint(args)
    if problem:  # before torch, and before lm-eval indexes its tasks
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    _cpu_without_cuda(args)
    from mmtrain.convert.checkpoint_io import ConvertError  # torch from here on
    from mmtrain.convert.hf_tokenizer import TokenizerExportError
    from mmtrain.lm_eval_model import MMTrainLMError
    from mmtrain.utils.dcp_storage import CheckpointFormatError

    try:
        parser.execute(args)
    except (MMTrainLMError, ConvertError, TokenizerExportError, CheckpointFormatError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
else:  # `import mmtrain.lm_eval`: the model is registered for lm_eval.simple_evaluate(model="mmtrain")
    register()
