"""Command line: ``python -m mmtrain.convert {hf-to-mmtrain,mmtrain-to-hf,compare,rehash} ...``.

Torch and the converters are imported once the arguments are parsed and the input paths found: ``--help`` and a
missing ``--hf`` / ``--ckpt`` answer at once."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> torch dtype name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mmtrain.convert",
                                     description="Convert Hugging Face Llama/Qwen2/Mixtral, DeepSeek-V3, LLaVA, "
                                                 "CLIP/SigLIP vision and Whisper folders to and from mmtrain "
                                                 "checkpoints, and compare the two.")
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
    to_hf.add_argument("--lora", choices=("merge", "adapter"), default="merge",
                       help="a LoRA run's checkpoint: write the merged model (default) or only the adapter "
                            "(peft format, for the HF export of the base)")
    cmp = sub.add_parser("compare", help="HF model and mmtrain checkpoint on the same input (fp32): max |diff| "
                                         "per part; exit 0 under --tol, 1 above")
    cmp.add_argument("--hf", required=True, help="Hugging Face model folder")
    cmp.add_argument("--ckpt", required=True, help="checkpoint step folder, or a checkpoints root with `latest`")
    cmp.add_argument("--image", default=None, help="image file (default: deterministic noise)")
    cmp.add_argument("--audio", default=None, help="audio file for a Whisper encoder (default: noise features)")
    cmp.add_argument("--text", default="a photo of", help="prompt text (after the image placeholders)")
    cmp.add_argument("--tol", type=float, default=1e-4, help="largest max |diff| that passes")
    to_hf.add_argument("--tokenizer", default=None,
                       help="tokenizer to export with the weights (.model, tokenizer.json or its folder, GPT-2 "
                            "vocab.json); default: the one the checkpoint's data manifest names")
    to_hf.add_argument("--no-tokenizer", action="store_true",
                       help="write weights and config.json only (no tokenizer files, no generation_config.json)")
    rehash = sub.add_parser("rehash", help="bring a checkpoint to this version's format: check its files against "
                                           "checksums.json, hash those it lacks (a checkpoint from before "
                                           "checksums), seal complete.json (also after editing it on purpose)")
    rehash.add_argument("--ckpt", required=True, help="checkpoint step folder, or a checkpoints root with `latest`")
    rehash.add_argument("--trust-current-files", action="store_true",
                        help="hash every file as it is now, checking nothing (a checkpoint that lost its "
                             "checksums.json, whose files you know are intact)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done (compare: equal within --tol), 1 compare found a larger difference, 2 a bad input
    (one line on stderr naming the file: missing, damaged, unsupported)."""
    args = build_parser().parse_args(argv)
    for key in ("hf", "ckpt"):
        path = getattr(args, key, None)
        if path is not None and not Path(path).exists():
            print(f"python -m mmtrain.convert {args.command}: error: --{key} {path}: not found (looked for "
                  f"{Path(path).resolve()})", file=sys.stderr)
            return 2
    from mmtrain.convert.checkpoint_io import ConvertError  # torch from here on
    from mmtrain.convert.hf_files import HFFolderError
    from mmtrain.convert.hf_tokenizer import TokenizerExportError
    from mmtrain.models.encoders_hf import EncoderHFError
    from mmtrain.models.registry import hf_errors
    from mmtrain.utils.dcp_storage import CheckpointFormatError

    try:
        return _run(args)
    except (ConvertError, EncoderHFError, *hf_errors(), HFFolderError, TokenizerExportError, CheckpointFormatError,
            FileNotFoundError) as exc:
        print(f"python -m mmtrain.convert {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import torch

    from mmtrain.convert.convert import hf_to_mmtrain, mmtrain_to_hf

    if args.command == "hf-to-mmtrain":
        folder = hf_to_mmtrain(args.hf, args.out, args.tp, args.pp, args.pipeline_layers)
        meta = json.loads((folder / "complete.json").read_text())
        layout = meta["layout"]  # a tower alone is written for pp=1 (it lives on the first stage)
        print(f"wrote weights-only checkpoint {folder} (tp={layout['tp']}, pp={layout['pp']}); model config in "
              f"{folder.parent / 'model.yaml'}")
        if not meta.get("vlm_parts"):
            tok = meta.get("tokenizer")
            print(f"tokenizer recorded: {tok['path']}" if tok else "no tokenizer recorded (the HF folder has no "
                  "tokenizer.json that loads)")
        if meta.get("vlm_parts"):
            left = meta.get("hf_left_out") or []
            print(f"VLM parts {', '.join(meta['vlm_parts'])}; {len(left)} HF tensor(s) left out on purpose"
                  + (f" (e.g. {left[0]})" if left else ""))
    elif args.command == "rehash":
        from mmtrain.convert.checkpoint_io import resolve_checkpoint_folder
        from mmtrain.utils.checkpoint_marker import reseal_checkpoint

        report = reseal_checkpoint(resolve_checkpoint_folder(args.ckpt), args.trust_current_files)
        print(f"sealed {report.folder}/complete.json: {len(report.checked)} file(s) matched checksums.json, "
              f"{len(report.hashed)} hashed as they are now ({', '.join(report.hashed) or 'none'})")
    elif args.command == "compare":
        from mmtrain.convert.compare import compare

        worst = compare(args.hf, args.ckpt, args.image, args.audio, args.text)
        ok = worst < args.tol
        print(f"{'OK' if ok else 'DIFFERENT'}: largest max |diff| {worst:.3e} {'<' if ok else '>='} {args.tol:g}")
        return 0 if ok else 1
    else:
        dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
        folder = mmtrain_to_hf(args.ckpt, args.out, dtype, args.lora,
                               tokenizer=args.tokenizer, with_tokenizer=not args.no_tokenizer)
        if (folder / "tokenizer_config.json").is_file():
            print(f"wrote Hugging Face folder {folder} (weights, tokenizer, generation_config.json)")
        elif (folder / "adapter_config.json").is_file():
            print(f"wrote peft adapter folder {folder}")
        else:
            print(f"wrote Hugging Face folder {folder} (weights only: no --tokenizer given and the checkpoint's "
                  "data names none; pass --tokenizer to add one)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
