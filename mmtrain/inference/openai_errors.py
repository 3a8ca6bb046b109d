"""Every error of the OpenAI-compatible server in OpenAI's shape, ``{"error": {"message", "type", "param",
"code"}}``, whatever refused the request: the request-size limit (``BodyLimit``, 413), the body's JSON or its
fields (400), an unknown path or method (404 / 405), the handlers themselves, or a bug (500; only a bug logs a
traceback).

``BodyLimit`` reads a request's body before the app does, at most ``max_bytes`` of it: a body declared or found
larger gets its 413 before another byte is read (the rest is discarded by the HTTP server, never buffered)."""

from __future__ import annotations

import sys

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt as text or token ids is well under 1 MiB


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error body: ``type`` is ``invalid_request_error`` for a 4xx, ``server_error`` for a 5xx."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # never a lone surrogate in the JSON
    return JSONResponse(status_code=status, headers=headers,
                        content={"error": {"message": message, "type": kind, "param": param, "code": code}})


class BodyLimit:
    """ASGI middleware: an HTTP request body of more than ``max_bytes`` gets a 413 in OpenAI's shape at once when
    its Content-Length says so, else as soon as the bytes received pass the limit; a body within it reaches the
    app as one message (later messages, such as the client's disconnect, pass through)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large(declared, scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away before its body was complete: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(None, scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()
            message, body = body, None
            return message

        await self.app(scope, replay, send)

    async def _too_large(self, declared: int | None, scope: Scope, receive: Receive, send: Send) -> None:
        size = f"of {declared} bytes " if declared is not None else ""
        response = error_response(413, f"the request body {size}is larger than this server's limit of "
                                       f"{self.max_bytes} bytes (python -m mmtrain.serve --max-request-bytes)",
                                  code="request_too_large")
        await response(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Answer the app's own refusals and any unexpected exception in OpenAI's shape."""

    @app.exception_handler(RequestValidationError)
    async def bad_fields(request: Request, exc: RequestValidationError):
        return error_response(400, *_validation_message(exc))

    @app.exception_handler(HTTPException)
    async def refused(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            return error_response(404, f"no endpoint {request.url.path}: this server has POST /v1/completions, "
                                       "POST /v1/chat/completions (when the tokenizer has a chat template), "
                                       "GET /v1/models and GET /health")
        if exc.status_code == 405:
            return error_response(405, f"{request.method} is not allowed on {request.url.path}",
                                  headers=exc.headers)
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body
            return error_response(400, _unparsable_body(exc.__cause__))
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):  # a bug: the server logs its traceback
        return error_response(500, f"the server failed on this request ({type(exc).__name__}); see its log")


def _unparsable_body(cause: BaseException) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not UTF-8 text (byte 0x{cause.object[cause.start]:02x} at offset "
                f"{cause.start}); send JSON encoded as UTF-8")
    if isinstance(cause, RecursionError):
        return "the request body nests arrays or objects too deeply to parse"
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return (f"the request body has an integer of more than {sys.get_int_max_str_digits()} digits; no field "
                "takes such a number")
    return f"the request body is not valid JSON ({type(cause).__name__})"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The most telling error (a value's problem before a wrong type; in a union, the member that got furthest)
    as ``field.path: message`` and the field."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = min(errors, key=lambda e: (str(e.get("type", "")).endswith("_type"), -len(_field_path(e))))
    if first.get("type") == "json_invalid":
        where = [x for x in first.get("loc", ()) if isinstance(x, int)]
        at = f" at character {where[0]}" if where else ""
        return f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'parse error')}{at})", None
    path = _field_path(first)
    field = ".".join(path) or None
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        msg = "unknown field"
    return (f"{field}: {msg}" if field else msg), field


_UNION_MEMBERS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(error: dict) -> list[str]:
    """The error's location as field names and list indices, without "body" and pydantic's union member labels
    (``str``, ``list[int]``, ``function-after[...]``)."""
    return [str(x) for x in error.get("loc", ()) if isinstance(x, int) or (
        x != "body" and x not in _UNION_MEMBERS and "[" not in str(x))]


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            if not value.isdigit():
                return None
            return int(value) if len(value) < 19 else 1 << 63  # no int() of a header's thousands of digits
    return None
