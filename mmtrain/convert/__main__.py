"""Command line: ``python -m mmtrain.convert {hf-to-mmtrain,mmtrain-to-hf} ...``."""

from __future__ import annotations

import argparse
import sys

import torch

from mmtrain.convert.checkpoint_io import ConvertError
from mmtrain.convert.convert import hf_to_mmtrain, mmtrain_to_hf
from mmtrain.convert.hf_files import HFFolderError
from mmtrain.convert.hf_tokenizer import TokenizerExportError
from mmtrain.models.registry import hf_errors
from mmtrain.utils.dcp_storage import CheckpointFormatError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mmtrain.convert",
                                     description="Convert Hugging Face Llama/Qwen2/Mixtral and DeepSeek-V3 folders "
                                                 "to and from mmtrain checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    to_ours = sub.add_parser("hf-to-mmtrain", help="HF folder (config.json + safetensors) -> weights-only checkpoint")
    to_ours.add_argument("--hf", required=True, help="Hugging Face model folder")
    to_ours.add_argument("--out", required=True, help="checkpoints root to create (step_00000000/, latest, model.yaml)")
    to_ours.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the written layout")
    to_ours.add_argument("--pp", type=int, default=1, help="pipeline-parallel size of the written layout")
    to_ours.add_argument("--pipeline-layers", type=int, nargs="*", default=None,
                         help="layers per pipeline stage (as parallel.pipeline_layers); default even")
    to_hf = sub.add_parser("mmtrain-to-hf", help="mmtrain checkpoint (any TP/PP) -> HF folder")
    to_hf.add_argument("--ckpt", required=True, help="checkpoint step folder, or a checkpoints root with `latest`")
    to_hf.add_argument("--out", required=True, help="Hugging Face folder to write")
    to_hf.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="cast weights (default: as stored)")
    to_hf.add_argument("--tokenizer", default=None,
                       help="tokenizer to export with the weights (.model, tokenizer.json or its folder, GPT-2 "
                            "vocab.json); default: the one the checkpoint's data manifest names")
    to_hf.add_argument("--no-tokenizer", action="store_true",
                       help="write weights and config.json only (no tokenizer files, no generation_config.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 a bad input (one line on stderr naming the file: missing, damaged, unsupported)."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ConvertError, *hf_errors(), HFFolderError, TokenizerExportError, CheckpointFormatError,
            FileNotFoundError) as exc:
        print(f"python -m mmtrain.convert {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "hf-to-mmtrain":
        folder = hf_to_mmtrain(args.hf, args.out, args.tp, args.pp, args.pipeline_layers)
        print(f"wrote weights-only checkpoint {folder} (tp={args.tp}, pp={args.pp}); model config in "
              f"{folder.parent / 'model.yaml'}")
    else:
        folder = mmtrain_to_hf(args.ckpt, args.out, DTYPES.get(args.dtype) if args.dtype else None,
                               tokenizer=args.tokenizer, with_tokenizer=not args.no_tokenizer)
        if (folder / "tokenizer_config.json").is_file():
            print(f"wrote Hugging Face folder {folder} (weights, tokenizer, generation_config.json)")
        else:
            print(f"wrote Hugging Face folder {folder} (weights only: no --tokenizer given and the checkpoint's "
                  "data names none; pass --tokenizer to add one)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
