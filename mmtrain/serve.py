"""Command line: ``python -m mmtrain.serve --ckpt CKPT --tokenizer TOK [--host 127.0.0.1] [--port 8000]``: an
OpenAI-compatible HTTP server (FastAPI + uvicorn, ``mmtrain.inference.openai_app``, in a frontend process of its
own: ``inference.frontend_process``) over one process's model, with continuous batching in ``--slots`` KV-cache
slots of ``--context`` positions; under ``torchrun --nproc_per_node N`` the model is tensor-parallel over the N
ranks (rank 0 serves, ``inference.step_broadcast``).
Needs ``pip install 'mmtrain[serve]'``. Exit codes: 0 stopped (SIGINT / SIGTERM to rank 0), 1 a rank failed or
stopped answering, 2 a bad argument, a port in use (found before the model loads), a tokenizer or checkpoint, or a
KV cache larger than the device's free memory (one line on stderr)."""

from __future__ import annotations

import argparse
import os
import sys

from mmtrain.utils.cli import OneLineArgumentParser, checkpoint_display_name, startup_error

PROG = "python -m mmtrain.serve"
MAX_REQUEST_BYTES = 4 << 20  # --max-request-bytes' default (4 MiB): well over a 128k-token prompt's body


def build_parser() -> argparse.ArgumentParser:
    ap = OneLineArgumentParser(prog=PROG, description="Serve an mmtrain checkpoint over an OpenAI-compatible HTTP API.")
    ap.add_argument("--ckpt", required=True, help="checkpoint step folder, or a checkpoints root with `latest`")
    ap.add_argument("--tokenizer", required=True, help="the model's tokenizer (tokenizer.json or its folder, "
                                                       "SentencePiece .model, GPT-2 vocab.json)")
    ap.add_argument("--chat-template", default="tokenizer", metavar="NAME",
                    help="chat template of /v1/chat/completions: 'tokenizer' (its own: chat_template.jinja or "
                         "tokenizer_config.json next to it; default), a built-in (chatml, llama3) or a .jinja file")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0: any free port (the log line says which)")
    ap.add_argument("--model-name", default=None, help="the name clients ask for (default: its run folder's)")
    ap.add_argument("--slots", type=int, default=32, help="requests decoded together (KV-cache slots)")
    ap.add_argument("--context", type=int, default=2048, help="positions per slot: prompt + new tokens (the KV "
                                                               "cache, --slots x --context, must fit the device)")
    ap.add_argument("--max-request-bytes", type=int, default=MAX_REQUEST_BYTES,
                    help="largest request body accepted; a larger one gets a 413 before it is read (default 4 MiB)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default=None, help="default bf16 on GPU, fp32 on CPU")
    ap.add_argument("--compile", action="store_true", help="torch.compile the decode step (CUDA graphs on GPU)")
    ap.add_argument("--peer-timeout", type=float, default=60.0,
                    help="under torchrun (tensor-parallel): seconds a rank waits for another before it gives up")
    return ap


def build_server_app(ckpt, tokenizer_path, model_name: str | None = None, slots: int = 32, context: int = 2048,
                     device: str = "auto", dtype: str | None = None, compile: bool = False,
                     chat_template: str = "tokenizer", max_request_bytes: int = MAX_REQUEST_BYTES):
    """(FastAPI app, its EngineThread): the model of ``ckpt`` in one process, ready to serve."""
    from mmtrain.inference.openai_app import build_app
    from mmtrain.inference.server_engine import EngineThread, freeze_heap
    from mmtrain.parallel import init_distributed, pick_device, shutdown_distributed

    dev = pick_device(device)
    init_distributed(device=dev)
    try:
        served = _load_served(ckpt, tokenizer_path, 1, dev, dtype, chat_template)
    finally:
        shutdown_distributed()  # one process: the model holds no process group
    engine = EngineThread(served.engine(slots, context, compile))
    if compile:
        engine.warmup()  # compiles (minutes) before the port opens, not on the first request
    freeze_heap()
    return build_app(engine, served.tokenizer, model_name or checkpoint_display_name(ckpt), served.renderer,
                     max_request_bytes), engine


class _Served:
    """What every rank loads: the tokenizer (and its chat template) and this rank's model."""

    def __init__(self, tokenizer, renderer, model) -> None:
        self.tokenizer, self.renderer, self.model = tokenizer, renderer, model

    def engine(self, slots: int, context: int, compile: bool, peers=None):
        from mmtrain.inference.engine import DecodeEngine

        return DecodeEngine(self.model, slots, context, compile=compile, peers=peers)


def _load_served(ckpt, tokenizer_path, tp: int, dev, dtype: str | None, chat_template: str = "tokenizer") -> _Served:
    """The tokenizer, the chat template's prompts and this rank's TP shard of ``ckpt``'s model (a process group of
    ``tp`` ranks is up). Raises the one-line errors ``main`` prints."""
    from mmtrain.core.tokenizer import load_tokenizer
    from mmtrain.inference.loading import DTYPES, load_checkpoint_model
    from mmtrain.inference.prompts import PromptError
    from mmtrain.parallel import ParallelDims

    tokenizer = load_tokenizer(tokenizer_path)
    renderer = chat_prompts(tokenizer, tokenizer_path, chat_template)
    model, cfg = load_checkpoint_model(ckpt, ParallelDims(tp, tp=tp).build(), dev,
                                       DTYPES[dtype or ("bf16" if dev.type == "cuda" else "fp32")])
    if tokenizer.max_id >= cfg.shape().vocab_size:  # the family's shape (model.deepseek_v3 for DeepSeek-V3)
        raise PromptError(f"{tokenizer_path}: the tokenizer has ids up to {tokenizer.max_id} but the model's "
                          f"vocab_size is {cfg.shape().vocab_size}; is it the tokenizer the model was trained with?")
    return _Served(tokenizer, renderer, model)


def chat_prompts(tokenizer, tokenizer_path, name: str):
    """The ``ChatPrompts`` of ``--chat-template NAME`` (`mmtrain-prep sft`'s renderer and bos/eos strings), or None
    when NAME is ``tokenizer`` and it has no template (chat requests then get a 400 saying how to give one)."""
    from mmtrain.core.chat_template import ChatPrompts, NoChatTemplateError, check_template_tokens, load_chat_template

    try:
        template = load_chat_template(name, tokenizer_path)
    except NoChatTemplateError:
        return None
    check_template_tokens(template, tokenizer, str(tokenizer_path))
    return ChatPrompts(template, tokenizer)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if (args.slots < 1 or args.context < 2 or not 0 <= args.port < 65536 or not args.peer_timeout > 0
            or args.max_request_bytes < 1):
        build_parser().error("--slots must be >= 1, --context >= 2, --port in 0..65535, --peer-timeout > 0, "
                             "--max-request-bytes >= 1")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print(f"{PROG}: error: serving needs FastAPI and uvicorn: pip install 'mmtrain[serve]'", file=sys.stderr)
        return 2
    from mmtrain.parallel import init_distributed, pick_device, shutdown_distributed

    dev = pick_device(args.device)
    rank, world = init_distributed(device=dev)
    try:
        return _serve(args, dev, rank, world)
    finally:
        shutdown_distributed()


def _serve(args: argparse.Namespace, dev, rank: int, world: int) -> int:
    """Rank 0: the scheduler, and the HTTP server in a process it starts; the other ranks (under torchrun:
    tensor-parallel, TP = the number of processes) repeat its model calls on their shards until it stops."""
    import signal
    from functools import partial

    from mmtrain.convert.checkpoint_io import ConvertError
    from mmtrain.core.tokenizer import TokenizerError
    from mmtrain.core.chat_tokens import ChatTemplateError
    from mmtrain.inference.decoder import UnsupportedModelError
    from mmtrain.inference.memory import CacheSizeError
    from mmtrain.inference.frontend_process import FrontendError, serve_with_frontend
    from mmtrain.inference.prompts import PromptError
    from mmtrain.inference.server_engine import EngineThread
    from mmtrain.inference.step_broadcast import PeerLostError, StepChannel, StepLeader, follow
    from mmtrain.parallel import ParallelDims, shutdown_distributed
    from mmtrain.utils.dcp_storage import CheckpointFormatError
    from mmtrain.utils.log import get_logger, setup_logging

    setup_logging(rank)
    listener = None
    if rank == 0:  # the port first: one in use is reported at once, not after the model has loaded
        try:
            listener = _listen(args.host, args.port)
        except OSError as exc:
            reason = os.strerror(exc.errno) if (exc.errno or 0) > 0 else (exc.strerror or str(exc))  # gaierror: < 0
            print(f"{PROG}: error: cannot listen on {args.host}:{args.port}: {reason}; pick another --port "
                  f"(--port 0: any free one) or --host", file=sys.stderr, flush=True)
            return 2
    try:
        served = _load_served(args.ckpt, args.tokenizer, world, dev, args.dtype, args.chat_template)
    except (ConvertError, TokenizerError, UnsupportedModelError, ChatTemplateError, PromptError,
            CheckpointFormatError, FileNotFoundError) as exc:
        if listener is not None:
            listener.close()
        return startup_error(f"{PROG}: error: {exc}", rank, local_rank=rank)  # TP on one node: rank 0 prints
    if world == 1:
        shutdown_distributed()  # one process: the model holds no process group
    channel = StepChannel(ParallelDims(world, tp=world).build(), args.peer_timeout) if world > 1 else None
    try:
        decode_engine = served.engine(args.slots, args.context, args.compile,
                                      StepLeader(channel) if channel is not None and rank == 0 else None)
    except CacheSizeError as exc:  # every rank finds it (the same shard sizes): rank 0 prints
        if listener is not None:
            listener.close()
        return startup_error(f"{PROG}: error: {exc}: lower --context or --slots", rank, local_rank=rank)
    if rank != 0:
        # Ctrl-C reaches every process of the terminal's group: the server rank decides when the followers stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        engine = decode_engine
        try:
            follow(engine, channel)
        except PeerLostError as exc:
            print(f"{PROG}: [rank {rank}] error: {exc}", file=sys.stderr, flush=True)
            return 1
        return 0
    name = args.model_name or checkpoint_display_name(args.ckpt)
    engine = EngineThread(decode_engine)
    port = listener.getsockname()[1]
    layout = f"tensor-parallel over {world} ranks" if world > 1 else "one model process"

    def ready(frontend_pid: int) -> None:
        get_logger("serve").info(f"serving {name!r} on http://{_url_host(args.host)}:{port} (pid {os.getpid()}, "
                                 f"{layout}); the HTTP frontend is pid {frontend_pid}")
    try:
        if args.compile:
            engine.warmup()  # compiles (minutes) before the server answers, not on the first request
        # the app runs in a process of its own (frontend_process): SIGINT / SIGTERM here stop it gracefully, then
        # the engine (and the followers); the exit code is then 0
        serve_with_frontend(engine, served.tokenizer.decode, partial(frontend_parts, args.tokenizer,
                                                                     args.chat_template),
                            name, args.max_request_bytes, listener, on_ready=ready)
    except FrontendError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        engine.close()
        listener.close()
    if engine.failure is not None:
        print(f"{PROG}: error: {engine.failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def frontend_parts(tokenizer_path, chat_template: str):
    """(tokenizer, ChatPrompts or None): what the HTTP frontend's process loads for itself (``frontend_process``;
    the engine's process has checked both already)."""
    from mmtrain.core.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    return tokenizer, chat_prompts(tokenizer, tokenizer_path, chat_template)


def _listen(host: str, port: int):
    """The server's listening socket, bound here rather than by uvicorn: a port in use is a one-line error, and
    with ``--port 0`` the log can name the port the system picked (a port chosen beforehand and bound later can
    be taken in between)."""
    import socket

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    return socket.create_server((host, port), family=family, backlog=2048)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


if __name__ == "__main__":
    sys.exit(main())
