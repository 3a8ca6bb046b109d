"""Command line: ``python -m mmtrain.quantize --ckpt CKPT --scheme fp8|w4a16 [--method rtn|gptq] [--calib PREFIX]
--out DIR``. Torch is imported once the arguments are checked: ``--help`` and a missing ``--ckpt`` or ``--calib``
answer at once. Exit codes: 0 written, 2 a bad argument or input (one line on stderr naming it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmtrain.utils.cli import OneLineArgumentParser

PROG = "python -m mmtrain.quantize"
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(prog=PROG, description="Quantize an mmtrain checkpoint into a Hugging Face folder in "
                                                      "the compressed-tensors format (docs/quantization.md).")
    ap.add_argument("--ckpt", required=True, help="checkpoint step folder, or a checkpoints root with `latest`")
    ap.add_argument("--out", required=True, help="folder to write (an earlier output of this command is replaced "
                                                 "once the new one is complete; any other existing folder is refused)")
    ap.add_argument("--scheme", required=True, help="fp8 (FP8 weights per channel, dynamic per-token FP8 "
                                                    "activations) or w4a16 (int4 weights in groups, 16-bit activations)")
    ap.add_argument("--method", default="rtn", help="w4a16: rtn (round to nearest) or gptq (calibrated on --calib); "
                                                    "fp8: rtn")
    ap.add_argument("--calib", default=None, help="prepared data for --method gptq: an indexed PREFIX "
                                                  "(PREFIX.bin/.idx of mmtrain-prep text) or a blend-spec .yaml")
    ap.add_argument("--samples", type=int, default=256, help="calibration samples (default 256)")
    ap.add_argument("--seq-len", type=int, default=2048, help="tokens per calibration sample (default 2048)")
    ap.add_argument("--batch-size", type=int, default=8, help="calibration samples per forward (default 8)")
    ap.add_argument("--group-size", type=int, default=128, help="w4a16: inputs sharing a scale (32, 64, 128 or 256; "
                                                                "default 128, compressed-tensors' W4A16)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="dtype of the dense tensors and scales (default: as stored in the checkpoint)")
    ap.add_argument("--seed", type=int, default=1234, help="order of the calibration samples")
    ap.add_argument("--tokenizer", default=None, help="tokenizer to write with the model (default: the one the "
                                                      "checkpoint names)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where the model is quantized (auto: a GPU if there is one)")
    return ap


def _check(args: argparse.Namespace) -> str | None:
    """The checks that need no torch; the first problem as one line, or None."""
    for name in ("samples", "seq_len", "batch_size"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1"
    if not Path(args.ckpt).exists():
        return f"--ckpt {args.ckpt}: not found (looked for {Path(args.ckpt).resolve()})"
    if args.calib is not None and Path(args.calib).suffix in (".yaml", ".yml", ".json"):
        return None if Path(args.calib).is_file() else f"--calib {args.calib}: blend spec not found"
    if args.calib is not None:
        missing = [p for p in (f"{args.calib}.idx", f"{args.calib}.bin") if not Path(p).is_file()]
        if missing:
            return (f"--calib {args.calib}: not prepared data (missing {', '.join(missing)}); give the PREFIX that "
                    "mmtrain-prep text wrote PREFIX.bin/.idx for")
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    problem = _check(args)
    if problem:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    import torch  # after the argument checks

    from mmtrain.config import ConfigError
    from mmtrain.convert.checkpoint_io import ConvertError
    from mmtrain.convert.hf_files import HFFolderError
    from mmtrain.convert.hf_tokenizer import TokenizerExportError
    from mmtrain.core.indexed import IndexedFormatError
    from mmtrain.core.manifest import ManifestError
    from mmtrain.data.blend_spec import BlendSpecError
    from mmtrain.models.registry import hf_errors
    from mmtrain.parallel import pick_device
    from mmtrain.quantize.run import QuantizeSettings, quantize_checkpoint
    from mmtrain.utils.dcp_storage import CheckpointFormatError

    settings = QuantizeSettings(args.scheme, args.method, args.calib, args.samples, args.seq_len, args.batch_size,
                                args.group_size, getattr(torch, DTYPES[args.dtype]) if args.dtype else None,
                                args.seed, args.tokenizer)
    try:
        folder = quantize_checkpoint(args.ckpt, args.out, settings, pick_device(args.device),
                                     log=lambda line: print(line, file=sys.stderr))
    except (ConvertError, ConfigError, HFFolderError, TokenizerExportError, IndexedFormatError, ManifestError,
            BlendSpecError, CheckpointFormatError, *hf_errors()) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {settings.scheme} ({settings.method}) compressed-tensors folder {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
