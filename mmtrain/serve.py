"""Command line: ``python -m mmtrain.serve --ckpt CKPT --tokenizer TOK [--host 127.0.0.1] [--port 8000]``: an
OpenAI-compatible HTTP server (FastAPI + uvicorn, ``mmtrain.inference.openai_app``) over one process's model,
with continuous batching in ``--slots`` KV-cache slots of ``--context`` positions. Needs ``pip install
'mmtrain[serve]'``. Exit codes: 0 stopped, 2 a bad argument, tokenizer or checkpoint (one line on stderr)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmtrain.utils.cli import OneLineArgumentParser

PROG = "python -m mmtrain.serve"


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(prog=PROG, description="Serve an mmtrain checkpoint over an OpenAI-compatible HTTP API.")
    ap.add_argument("--ckpt", required=True, help="checkpoint step folder, or a checkpoints root with `latest`")
    ap.add_argument("--tokenizer", required=True, help="the model's tokenizer (its chat template, if any, is read "
                                                       "from tokenizer_config.json next to it)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model-name", default=None, help="the name clients ask for (default: the checkpoint folder's)")
    ap.add_argument("--slots", type=int, default=32, help="requests decoded together (KV-cache slots)")
    ap.add_argument("--context", type=int, default=2048, help="positions per slot: prompt + new tokens")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default=None, help="default bf16 on GPU, fp32 on CPU")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on GPU)")
    return ap


def build_server_app(ckpt, tokenizer_path, model_name: str | None = None, slots: int = 32, context: int = 2048,
                     device: str = "auto", dtype: str | None = None, compile: bool = False):
    """(FastAPI app, its EngineThread): the model of ``ckpt`` in one process, ready to serve."""
    from mmtrain.core.tokenizer import load_tokenizer
    from mmtrain.inference.chat import ChatRenderer, load_chat_template
    from mmtrain.inference.engine import DecodeEngine
    from mmtrain.inference.loading import DTYPES, load_checkpoint_model
    from mmtrain.inference.openai_app import build_app
    from mmtrain.inference.prompts import PromptError
    from mmtrain.inference.server_engine import EngineThread
    from mmtrain.parallel import ParallelDims, init_distributed, pick_device, shutdown_distributed

    tokenizer = load_tokenizer(tokenizer_path)
    template = load_chat_template(tokenizer_path)
    renderer = ChatRenderer(template, _special_tokens(tokenizer)) if template else None
    dev = pick_device(device)
    init_distributed(device=dev)
    try:
        model, cfg = load_checkpoint_model(ckpt, ParallelDims(1).build(), dev,
                                           DTYPES[dtype or ("bf16" if dev.type == "cuda" else "fp32")])
    finally:
        shutdown_distributed()  # one process: the model holds no process group
    if tokenizer.max_id >= cfg.shape().vocab_size:  # the family's shape (model.deepseek_v3 for DeepSeek-V3)
        raise PromptError(f"{tokenizer_path}: the tokenizer has ids up to {tokenizer.max_id} but the model's "
                          f"vocab_size is {cfg.shape().vocab_size}; is it the tokenizer the model was trained with?")
    engine = EngineThread(DecodeEngine(model, slots, context, compile=compile))
    if compile:
        engine.warmup()  # compiles (minutes) before the port opens, not on the first request
    name = model_name or Path(ckpt).resolve().name
    return build_app(engine, tokenizer, name, renderer), engine


def _special_tokens(tokenizer) -> dict[str, str]:
    """bos_token / eos_token strings a chat template may use."""
    eos = tokenizer.decode([tokenizer.eod_id]) if tokenizer.eod_id is not None else ""
    return {"eos_token": eos, "bos_token": ""}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.slots < 1 or args.context < 2 or not 0 <= args.port < 65536:
        build_parser().error("--slots must be >= 1, --context >= 2, --port in 0..65535")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        print(f"{PROG}: error: serving needs FastAPI and uvicorn: pip install 'mmtrain[serve]'", file=sys.stderr)
        return 2
    from mmtrain.convert.checkpoint_io import ConvertError
    from mmtrain.core.tokenizer import TokenizerError
    from mmtrain.inference.chat import ChatTemplateError
    from mmtrain.inference.decoder import UnsupportedModelError
    from mmtrain.inference.prompts import PromptError
    from mmtrain.utils.dcp_storage import CheckpointFormatError

    try:
        app, engine = build_server_app(args.ckpt, args.tokenizer, args.model_name, args.slots, args.context,
                                       args.device, args.dtype, args.compile)
    except (ConvertError, TokenizerError, UnsupportedModelError, ChatTemplateError, PromptError,
            CheckpointFormatError, FileNotFoundError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
