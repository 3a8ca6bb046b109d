"""The OpenAI-compatible HTTP API on FastAPI: ``POST /v1/completions``, ``POST /v1/chat/completions`` (a 400 saying
how to give a chat template when the server has none), server-sent-event streaming, ``GET /v1/models``, ``GET /health``.

Handlers only check and wait: the model runs in the engine (``engine_client``: its thread in this process, or
its own process), tokenizing and chat rendering run in worker threads, so a large request never holds up the
event loop (``/health``, the running streams). A stream sends one event per engine step that gave it text, or
fewer, larger ones when it falls behind (all its text waiting at once); the event's bytes around its text are
encoded once per stream. A body over ``max_request_bytes`` is refused (413) before more of it is
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
from mmtrain.inference.engine import ContextLengthError
from mmtrain.inference.engine_client import Completion, EngineClient, ThreadEngineClient
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
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model_name: str,
                 chat: ChatPrompts | None) -> None:
        self.engine, self.tokenizer, self.model_name, self.chat = engine, tokenizer, model_name, chat
        self.created = int(time.time())
        self.stop_ids = () if tokenizer.eod_id is None else (tokenizer.eod_id,)

    def encode_prompt(self, text: str) -> list[int]:
        """``text``'s token ids (in a worker thread); raises ContextLengthError without tokenizing all of a text
        whose first part already exceeds the context."""
        context = self.engine.max_len
        head = context * _PREFIX_CHARS_PER_POSITION
        if len(text) > head:
            n = len(self.tokenizer.encode(text[:head]))
            if n >= context:
                raise ContextLengthError(f"the prompt's first {head} characters alone are {n} tokens; the context "
                                         f"is {context} positions (prompt + max_tokens)")
        return self.tokenizer.encode(text)

    def check_length(self, n: int) -> None:
        """Raise ContextLengthError for a prompt of ``n`` tokens that leaves no room for a new one."""
        context = self.engine.max_len
        if n >= context:
            raise ContextLengthError(f"the prompt has {n} tokens; the context is {context} positions (prompt + "
                                     "max_tokens)")

    def start(self, prompt_ids: list[int], req, max_tokens: int | None,
              stop_ids: tuple[int, ...] = ()) -> Completion:
        """Check and submit one request (``stop_ids``: more ids that end it, a chat template's end of turn);
        raises SamplingError / ContextLengthError for a 400, EngineStopped for a 503."""
        context = self.engine.max_len
        n = len(prompt_ids)
        self.check_length(n)
        if max_tokens is None:
            max_tokens = context - n
        if n + max_tokens > context:
            raise ContextLengthError(f"max_tokens={max_tokens} + the prompt's {n} tokens exceeds the context of "
                                     f"{context} positions")
        params = SamplingParams(max_tokens, req.temperature, req.top_k, req.top_p, req.seed,
                                tuple(dict.fromkeys(self.stop_ids + stop_ids)), req.stop_strings())
        return self.engine.start(prompt_ids, params)

    def usage(self, completion: Completion) -> dict:
        n, m = len(completion.prompt_ids), completion.completion_tokens
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode()


_TEXT_MARK = "\x00mmtrain text\x00"  # stands for a chunk's text while its event's bytes are encoded once


class _Events:
    """A stream's SSE events from ``chunk(text, finish_reason, first)`` (its chunk object). An event with text and
    no finish reason after the first is the one-time encoding of a chunk with a marker for its text, the marker
    replaced by the text's JSON string: per event, one string encoded instead of the whole object."""

    def __init__(self, chunk) -> None:
        self.chunk = chunk
        head, mark, tail = _sse(chunk(_TEXT_MARK, None, False)).partition(json.dumps(_TEXT_MARK).encode())
        self.parts = (head, tail) if mark else None

    def event(self, text: str, finish_reason: str | None, first: bool) -> bytes:
        if self.parts is not None and text and finish_reason is None and not first:
            return self.parts[0] + json.dumps(text, ensure_ascii=False).encode() + self.parts[1]
        return _sse(self.chunk(text, finish_reason, first))


async def _collect(completion: Completion, engine: EngineClient, request: Request) -> bool:
    """Wait until ``completion`` has finished (True), or until its client disconnects (False): then it is
    cancelled and its slot is freed at the engine's next step, as a stream's is."""
    finished = asyncio.ensure_future(completion.wait())
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait((finished, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        finished.cancel()
        gone.cancel()
        if not completion.finished:
            engine.cancel(completion)
    return completion.finished


async def _disconnect(request: Request) -> None:
    """Returns when the client has disconnected (the body was read: what the server receives next is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _stream(completion: Completion, engine: EngineClient, chunk, final_usage) -> AsyncIterator[bytes]:
    """SSE events: one chunk per piece of text, the last with the finish reason, then ``[DONE]``. Pieces that
    arrived while the previous event was being sent go out together, so a busy server sends fewer, larger
    events instead of falling behind the decode steps."""
    events = _Events(chunk)
    try:
        first = True
        while True:
            text, done = await completion.next_text()
            if text or done or first:
                yield events.event(text, completion.finish_reason if done else None, first)
                first = False
            if done:
                break
        if final_usage is not None:
            yield _sse(final_usage())
        yield b"data: [DONE]\n\n"
    finally:
        if not completion.finished:
            engine.cancel(completion)  # the client went away: free the slot at the next step


_NO_TEMPLATE = ("this server has no chat template (its tokenizer has none: no chat_template.jinja, no chat_template "
                "in tokenizer_config.json); restart it with --chat-template chatml, llama3 or a .jinja file, or send "
                "the rendered prompt to /v1/completions")


def build_app(engine: EngineClient | EngineThread, tokenizer: Tokenizer, model_name: str,
              chat: ChatPrompts | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> FastAPI:
    """The FastAPI app serving ``engine`` (an ``EngineThread`` of this process is reached through a
    ``ThreadEngineClient``; ``chat``: the chat template's prompts; without it chat requests get a 400 saying how to
    give one). A request body of more than ``max_request_bytes`` gets a 413."""
    if isinstance(engine, EngineThread):
        engine = ThreadEngineClient(engine, tokenizer.decode)
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
                vocab = engine.vocab_size
                if any(not 0 <= t < vocab for t in req.prompt):
                    return _error(400, f"prompt: token ids must be in 0..{vocab - 1}", "prompt")
                if req.echo and max(req.prompt, default=0) > tokenizer.max_id:
                    return _error(400, f"prompt: echo shows the prompt's text, and ids above {tokenizer.max_id} "
                                       "have none in the tokenizer", "prompt")
                ids, prompt_text = req.prompt, None  # echoed as decoded, up to where the completion's text begins
            else:
                ids, prompt_text = await asyncio.to_thread(api.encode_prompt, req.prompt), req.prompt
            completion = api.start(ids, req, req.max_tokens or 16)
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
            return prompt_text if prompt_text is not None else tokenizer.decode(ids[:completion.prompt_text_end])

        def body(text, finish):
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
        if req.stream:
            def chunk(text, finish, first):
                return body((echo() if first else "") + text, finish)
            usage = None
            if (req.stream_options or {}).get("include_usage"):
                usage = lambda: {**body("", None), "choices": [], "usage": api.usage(completion)}  # noqa: E731
            return StreamingResponse(_stream(completion, engine, chunk, usage), media_type="text/event-stream")
        if not await _collect(completion, engine, request):
            return _error(400, "the client disconnected")  # nobody reads it
        if completion.finish_reason == "error":
            return _error(500, "generating this completion failed; see the server log")
        return {**body(echo() + completion.text, completion.finish_reason), "usage": api.usage(completion)}

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
                completion = api.start(prompt_ids, req, req.max_completion_tokens or req.max_tokens, chat_stop_ids)
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
                        return {**head("chat.completion.chunk"), "choices": [], "usage": api.usage(completion)}
                return StreamingResponse(_stream(completion, engine, chunk, usage), media_type="text/event-stream")
            if not await _collect(completion, engine, request):
                return _error(400, "the client disconnected")  # nobody reads it
            if completion.finish_reason == "error":
                return _error(500, "generating this completion failed; see the server log")
            return {**head("chat.completion"), "usage": api.usage(completion),
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text},
                                 "finish_reason": completion.finish_reason, "logprobs": None}]}

    return app
