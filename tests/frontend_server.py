"""A server laid out as ``python -m mmtrain.serve`` (the engine thread here, the app in a frontend process) over
the tiny model, with two failures the tests can trigger through HTTP: the token-id prompt ``POISON`` makes its
own text fail (it ends alone), ``FATAL`` makes the engine's step fail as a tensor-parallel one would (the server
stops). Usage: ``python -m tests.frontend_server TOKENIZER_JSON`` (port 0; the log names it)."""

from __future__ import annotations

import socket
import sys
from functools import partial

POISON = [5, 6, 7, 8, 9, 10]
FATAL = [11, 12, 13, 14, 15]


def frontend_parts(tokenizer_path: str):
    from mmtrain.core.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer_path), None


def main(tokenizer_path: str) -> int:
    from mmtrain.core.tokenizer import load_tokenizer
    from mmtrain.inference.engine import DecodeEngine
    from mmtrain.inference.frontend_process import serve_with_frontend
    from mmtrain.inference.server_engine import EngineThread
    from mmtrain.utils.log import get_logger, setup_logging
    from tests.inference_helpers import tiny_config, tiny_model

    class FailingEngine(DecodeEngine):
        tensor_parallel = True  # a failed step is fatal

        def step(self):
            if any(s.prompt_ids == FATAL for s in self.active.values()):
                raise RuntimeError("the step failed on purpose")
            return super().step()

    setup_logging(0)
    tok = load_tokenizer(tokenizer_path)

    def decode(ids):
        if list(ids) == POISON:
            raise ValueError("this prompt's text fails on purpose")
        return tok.decode(ids)
    engine = EngineThread(FailingEngine(tiny_model(tiny_config(vocab_size=tok.vocab_size)), 8, 96))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        serve_with_frontend(engine, decode, partial(frontend_parts, tokenizer_path), "tiny", 1 << 20, listener,
                            on_ready=lambda pid: get_logger("serve").info(
                                f"serving 'tiny' on http://127.0.0.1:{port} (frontend pid {pid})"))
    finally:
        engine.close()
        listener.close()
    return 1 if engine.failure is not None else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
