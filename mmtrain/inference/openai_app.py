"""The OpenAI-compatible HTTP API on FastAPI: ``POST /v1/completions``, ``POST /v1/chat/completions`` (a 400 saying
how to give a chat template when the server has none), server-sent-event streaming, ``GET /v1/models``, ``GET /health``.

Handlers only check and wait: the model runs in the engine thread (``server_engine.EngineThread``), and
tokenizing, detokenizing and chat rendering run in worker threads, so a large request never holds up the event
loop (``/health``, the running streams). A body over ``max_request_bytes`` is refused (413) before more of it is
read. Every refusal is a 4xx with OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``
(``openai_errors``); nothing a client sends stops the server or another client's request. A client that goes
away, streaming or not, frees its slot at the next step. Once the engine has stopped (a tensor-parallel failure,
or shutdown) requests get a 503 and ``/health`` says so.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mmtrain.core.chat_template import ChatPrompts
from mmtrain.core.chat_tokens import ChatTemplateError, RenderError
from mmtrain.core.tokenizer import Tokenizer
from mmtrain.inference.engine import ContextLengthError, Sequence
from mmtrain.inference.openai_errors import DEFAULT_MAX_REQUEST_BYTES, BodyLimit, install_error_handlers
from mmtrain.inference.openai_errors import error_response as _error
from mmtrain.inference.openai_schema import ChatCompletionRequest, CompletionRequest
from mmtrain.inference.sampling import SamplingError, SamplingParams
from mmtrain.inference.server_engine import EngineStopped, EngineThread


# A text prompt longer than this many characters per context position is tokenized in part first: when that part
# alone does not fit the context the request is refused without tokenizing the rest (a 4 MB prompt costs the
# tokenizer as much as 16 characters a position do, not the whole body).
_PREFIX_CHARS_PER_POSITION = 16


class _Api:
    def __init__(self, engine: EngineThread, tokenizer: Tokenizer, model_name: str,
                 chat: ChatPrompts | None) -> None:
        self.engine, self.tokenizer, self.model_name, self.chat = engine, tokenizer, model_name, chat
        self.created = int(time.time())
        self.stop_ids = () if tokenizer.eod_id is None else (tokenizer.eod_id,)

    def encode_prompt(self, text: str) -> list[int]:
        """``text``'s token ids (in a worker thread); raises ContextLengthError without tokenizing all of a text
        whose first part already exceeds the context."""
        context = self.engine.engine.max_len
        head = context * _PREFIX_CHARS_PER_POSITION
        if len(text) > head:
            n = len(self.tokenizer.encode(text[:head]))
            if n >= context:
                raise ContextLengthError(f"the prompt's first {head} characters alone are {n} tokens; the context "
                                         f"is {context} positions (prompt + max_tokens)")
        return self.tokenizer.encode(text)

    def check_length(self, n: int) -> None:
        """Raise ContextLengthError for a prompt of ``n`` tokens that leaves no room for a new one."""
        context = self.engine.engine.max_len
        if n >= context:
            raise ContextLengthError(f"the prompt has {n} tokens; the context is {context} positions (prompt + "
                                     "max_tokens)")

    def start(self, prompt_ids: list[int], req, max_tokens: int | None,
              stop_ids: tuple[int, ...] = ()) -> tuple[Sequence, asyncio.Queue]:
        """Check and submit one request (``stop_ids``: more ids that end it, a chat template's end of turn);
        raises SamplingError / ContextLengthError for a 400."""
        context = self.engine.engine.max_len
        n = len(prompt_ids)
        self.check_length(n)
        if max_tokens is None:
            max_tokens = context - n
        if n + max_tokens > context:
            raise ContextLengthError(f"max_tokens={max_tokens} + the prompt's {n} tokens exceeds the context of "
                                     f"{context} positions")
        params = SamplingParams(max_tokens, req.temperature, req.top_k, req.top_p, req.seed,
                                tuple(dict.fromkeys(self.stop_ids + stop_ids)), req.stop_strings())
        loop, out = asyncio.get_running_loop(), asyncio.Queue()
        seq = Sequence(prompt_ids, params, decode=self.tokenizer.decode,
                       on_token=lambda s, text, done: self.engine.deliver(loop, out, (text, done)))
        self.engine.check(seq)
        self.engine.submit(seq)
        return seq, out

    def usage(self, seq: Sequence) -> dict:
        n, m = len(seq.prompt_ids), len(seq.token_ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


async def _collect(seq: Sequence, out: asyncio.Queue, request: Request) -> bool:
    """Wait until ``seq`` has finished (True), or until its client disconnects (False): then it is cancelled and
    its slot is freed at the engine's next step, as a stream's is."""
    finished = asyncio.ensure_future(_until_done(out))
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((finished, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        finished.cancel()
        gone.cancel()
        if not seq.finished:
            seq.cancelled = True
    return seq.finished and not seq.cancelled


async def _until_done(out: asyncio.Queue) -> None:
    while not (await out.get())[1]:
        pass


async def _disconnect(request: Request) -> None:
    """Returns when the client has disconnected (the body was read: what the server receives next is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _drain(out: asyncio.Queue, text: str, done: bool) -> tuple[str, bool]:
    """``text`` and every piece already waiting on ``out`` after it, as one piece."""
    pieces = [text]
    while not done and not out.empty():
        more, done = out.get_nowait()
        pieces.append(more)
    return "".join(pieces), done


async def _stream(seq: Sequence, out: asyncio.Queue, chunk, final_usage) -> AsyncIterator[bytes]:
    """SSE events: one chunk per piece of text, the last with the finish reason, then ``[DONE]``. Pieces that
    arrived while the previous event was being sent go out together, so a busy server sends fewer, larger
    events instead of falling behind the decode steps."""
    try:
        first = True
        while True:
            text, done = _drain(out, *await out.get())
            if text or done or first:
                yield _sse(chunk(text, seq.finish_reason if done else None, first))
                first = False
            if done:
                break
        if final_usage is not None:
            yield _sse(final_usage())
        yield b"data: [DONE]\n\n"
    finally:
        if not seq.finished:
            seq.cancelled = True  # the client went away: free the slot at the next step


_NO_TEMPLATE = ("this server has no chat template (its tokenizer has none: no chat_template.jinja, no chat_template "
                "in tokenizer_config.json); restart it with --chat-template chatml, llama3 or a .jinja file, or send "
                "the rendered prompt to /v1/completions")


def build_app(engine: EngineThread, tokenizer: Tokenizer, model_name: str, chat: ChatPrompts | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app serving ``engine`` (``chat``: the chat template's prompts; without it chat requests get a
    400 saying how to give one). A request body of more than ``max_request_bytes`` gets a 413."""
    app = FastAPI(title="mmtrain", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    install_error_handlers(app)
    api = _Api(engine, tokenizer, model_name, chat)

    @app.get("/health")
    async def health():
        if engine.failure is not None:
            return JSONResponse(status_code=503, content={"status": "error", "message": engine.failure})
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": api.created,
                                            "owned_by": "mmtrain"}]}

    def wrong_model(req) -> JSONResponse | None:
        if req.model is not None and req.model != model_name:
            return _error(404, f"model {req.model!r} is not served here; GET /v1/models lists {model_name!r}",
                          "model", "model_not_found")
        return None

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        if (bad := wrong_model(req)) is not None:
            return bad
        try:
            if isinstance(req.prompt, list):
                api.check_length(len(req.prompt))
                vocab = engine.engine.model.cfg.vocab_size
                if any(not 0 <= t < vocab for t in req.prompt):
                    return _error(400, f"prompt: token ids must be in 0..{vocab - 1}", "prompt")
                if req.echo and max(req.prompt, default=0) > tokenizer.max_id:
                    return _error(400, f"prompt: echo shows the prompt's text, and ids above {tokenizer.max_id} "
                                       "have none in the tokenizer", "prompt")
                ids, prompt_text = req.prompt, None  # echoed as decoded, up to where the completion's text begins
            else:
                ids, prompt_text = await asyncio.to_thread(api.encode_prompt, req.prompt), req.prompt
            seq, out = api.start(ids, req, req.max_tokens or 16)
        except (SamplingError, ContextLengthError) as exc:
            return _error(400, str(exc), "max_tokens" if isinstance(exc, ContextLengthError) else None)
        except EngineStopped as exc:
            return _error(503, str(exc))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def echo() -> str:
            """The prompt's text before the completion's: echo + completion is the decode of both. Read once the
            engine has handed back text (a token-id prompt may end inside a character the completion completes)."""
            if not req.echo:
                return ""
            return prompt_text if prompt_text is not None else tokenizer.decode(ids[:seq.prompt_text_end])

        def body(text, finish):
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
        if req.stream:
            def chunk(text, finish, first):
                return body((echo() if first else "") + text, finish)
            usage = None
            if (req.stream_options or {}).get("include_usage"):
                usage = lambda: {**body("", None), "choices": [], "usage": api.usage(seq)}  # noqa: E731
            return StreamingResponse(_stream(seq, out, chunk, usage), media_type="text/event-stream")
        if not await _collect(seq, out, request):
            return _error(400, "the client disconnected")  # nobody reads it
        if seq.finish_reason == "error":
            return _error(500, "generating this completion failed; see the server log")
        return {**body(echo() + seq.text, seq.finish_reason), "usage": api.usage(seq)}

    if chat is None:  # the route exists: a client is told how to give a template, not a bare 404
        @app.post("/v1/chat/completions")
        async def chat_without_template(req: ChatCompletionRequest):
            return wrong_model(req) or _error(400, _NO_TEMPLATE)

    if chat is not None:
        chat_stop_ids = chat.stop_ids()  # a reply ends at the template's end of turn

        @app.post("/v1/chat/completions")
        async def chat_completions(req: ChatCompletionRequest, request: Request):
            if (bad := wrong_model(req)) is not None:
                return bad
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
            try:  # message text is text: only the template makes control tokens (mmtrain.core.chat_tokens)
                prompt_ids = await asyncio.to_thread(chat.prompt_ids, messages)
            except (ChatTemplateError, RenderError) as exc:
                return _error(400, str(exc), "messages")
            try:
                seq, out = api.start(prompt_ids, req, req.max_completion_tokens or req.max_tokens, chat_stop_ids)
            except (SamplingError, ContextLengthError) as exc:
                return _error(400, str(exc), "max_tokens" if isinstance(exc, ContextLengthError) else None)
            except EngineStopped as exc:
                return _error(503, str(exc))
            rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

            def head(kind):
                return {"id": rid, "object": kind, "created": created, "model": model_name}
            if req.stream:
                def chunk(text, finish, first):
                    delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
                    return {**head("chat.completion.chunk"),
                            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
                usage = None
                if (req.stream_options or {}).get("include_usage"):
                    def usage():
                        return {**head("chat.completion.chunk"), "choices": [], "usage": api.usage(seq)}
                return StreamingResponse(_stream(seq, out, chunk, usage), media_type="text/event-stream")
            if not await _collect(seq, out, request):
                return _error(400, "the client disconnected")  # nobody reads it
            if seq.finish_reason == "error":
                return _error(500, "generating this completion failed; see the server log")
            return {**head("chat.completion"), "usage": api.usage(seq),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": seq.text},
                                 "finish_reason": seq.finish_reason, "logprobs": None}]}

    return app
