"""Command line: ``python -m mmtrain.generate --ckpt CKPT --tokenizer TOK --prompt "..."``: complete prompts with
a checkpoint's model (KV-cache decoding, ``mmtrain.inference``), on CPU or GPU, under torchrun tensor-parallel
(every rank holds a TP shard; rank 0 prints). Exit codes: 0 done, 1 a prompt failed (its row says why; the others
are complete), 2 a bad argument, file or checkpoint, or a KV cache larger than the device's free memory (one line
on stderr, before the cache is allocated)."""

from __future__ import annotations

import argparse
import json
import sys

from mmtrain.utils.cli import OneLineArgumentParser

PROG = "python -m mmtrain.generate"


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(prog=PROG, description="Generate text from an mmtrain checkpoint (KV-cache decoding).")
    ap.add_argument("--ckpt", required=True, help="checkpoint step folder, or a checkpoints root with `latest`")
    ap.add_argument("--tokenizer", required=True, help="SentencePiece .model, tokenizer.json (or its folder), or "
                                                       "GPT-2 vocab.json next to merges.txt")
    ap.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for several)")
    ap.add_argument("--prompts-file", default=None, help='JSONL file of {"prompt": "..."} rows')
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt at most")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    ap.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 keeps all")
    ap.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set of mass p; 1 keeps all")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (prompt i uses seed + i)")
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeat for several)")
    ap.add_argument("--no-eod-stop", action="store_true", help="do not stop at the tokenizer's end-of-document token")
    ap.add_argument("--output", default=None, help="write the completions as JSONL rows here")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default=None, help="default bf16 on GPU, fp32 on CPU")
    ap.add_argument("--batch-size", type=int, default=32, help="prompts decoded together (KV-cache slots)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on GPU)")
    ap.add_argument("--allow-other-tokenizer", action="store_true",
                    help="use a --tokenizer that is not the one the checkpoint names (refused by default)")
    return ap


def _check_tokenizer(args: argparse.Namespace, tokenizer) -> None:
    """A ``--tokenizer`` that is not the one the checkpoint's model was trained with (``mmtrain.core.
    tokenizer_record``) is a ``TokenizerError``, unless ``--allow-other-tokenizer``: equal vocabulary sizes hide it."""
    from mmtrain.core.manifest import ManifestError
    from mmtrain.inference.loading import checkpoint_config
    from mmtrain.core.tokenizer import TokenizerError
    from mmtrain.core.tokenizer_record import describe_record, tokenizer_mismatch

    if args.allow_other_tokenizer:
        return
    given = tokenizer.describe()
    try:
        found = tokenizer_mismatch(checkpoint_config(args.ckpt)[1], given)
    except ManifestError as exc:
        raise TokenizerError(str(exc)) from None
    if found is not None:
        raise TokenizerError(f"--tokenizer {args.tokenizer} is {describe_record(given)}, but "
                             f"{args.ckpt}'s model was trained with {describe_record(found[0])} (from its {found[1]}); "
                             "pass that tokenizer, or --allow-other-tokenizer if this is intended")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.prompt and not args.prompts_file:
        build_parser().error("give --prompt and/or --prompts-file")
    if args.max_new_tokens < 1 or args.batch_size < 1:
        build_parser().error("--max-new-tokens and --batch-size must be >= 1")
    from mmtrain.convert.checkpoint_io import ConvertError  # imports torch: after the argument checks
    from mmtrain.core.tokenizer import TokenizerError
    from mmtrain.inference.decoder import UnsupportedModelError
    from mmtrain.inference.engine import ContextLengthError
    from mmtrain.inference.memory import CacheSizeError
    from mmtrain.inference.prompts import PromptError
    from mmtrain.inference.sampling import SamplingError
    from mmtrain.utils.dcp_storage import CheckpointFormatError

    try:
        _sampling(args, 0, ()).check()  # before anything is loaded or allocated
        return _run(args)
    except CacheSizeError as exc:
        print(f"{PROG}: error: {exc}: lower --max-new-tokens or --batch-size", file=sys.stderr)
        return 2
    except (ConvertError, TokenizerError, UnsupportedModelError, ContextLengthError, PromptError,
            SamplingError, CheckpointFormatError, FileNotFoundError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


def _sampling(args: argparse.Namespace, i: int, stops: tuple[int, ...]):
    """Prompt ``i``'s sampling parameters."""
    from mmtrain.inference.sampling import SamplingParams

    return SamplingParams(args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed + i, stops,
                          tuple(args.stop))


def _run(args: argparse.Namespace) -> int:
    import torch

    from mmtrain.core.tokenizer import load_tokenizer
    from mmtrain.inference.engine import DecodeEngine, generate
    from mmtrain.inference.loading import DTYPES, load_checkpoint_model
    from mmtrain.inference.prompts import PromptError, completion_row, read_prompts_file
    from mmtrain.parallel import ParallelDims, init_distributed, pick_device, shutdown_distributed
    from mmtrain.utils.atomic import atomic_write_text

    tokenizer = load_tokenizer(args.tokenizer)  # before any process group: a bad path is one line
    _check_tokenizer(args, tokenizer)
    prompts = list(args.prompt) + (read_prompts_file(args.prompts_file) if args.prompts_file else [])
    device = pick_device(args.device)
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    rank, world = init_distributed(device=device)
    try:
        mesh = ParallelDims(world, tp=world).build()
        model, cfg = load_checkpoint_model(args.ckpt, mesh, device, dtype)
        ids = tokenizer.encode_batch(prompts)
        vocab = cfg.shape().vocab_size  # the family's shape (model.deepseek_v3 for DeepSeek-V3)
        too_big = [i for i, p in enumerate(ids) if p and max(p) >= vocab]
        if too_big:
            raise PromptError(f"prompt {too_big[0]} has token ids >= the model's vocab_size {vocab}: "
                             "is --tokenizer the one the model was trained with?")
        stops = () if args.no_eod_stop or tokenizer.eod_id is None else (tokenizer.eod_id,)
        params = [_sampling(args, i, stops) for i in range(len(prompts))]
        longest = max(len(p) for p in ids) + args.max_new_tokens
        engine = DecodeEngine(model, min(args.batch_size, len(prompts)), longest, compile=args.compile)
        with torch.no_grad():
            seqs = generate(engine, ids, params, decode=tokenizer.decode)
    finally:
        shutdown_distributed()
    if rank == 0:
        rows = [completion_row(p, s) for p, s in zip(prompts, seqs)]
        if args.output:
            atomic_write_text(args.output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
        for r in rows:
            shown = {k: r[k] for k in ("prompt", "completion", "finish_reason", "error") if k in r}
            print(json.dumps(shown, ensure_ascii=False))
        for i, s in enumerate(seqs):
            if s.error is not None:
                print(f"{PROG}: error: prompt {i} failed: {s.error}", file=sys.stderr)
    return 1 if any(s.error is not None for s in seqs) else 0


if __name__ == "__main__":
    sys.exit(main())
