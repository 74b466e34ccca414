"""Request body checks shared by the server and the router, enforced before anything parses the
body; they live outside both packages and import nothing heavy (the router runs without torch).

A body larger than the cap is answered 413 at once when its Content-Length says so, and as soon as
the bytes read pass the cap otherwise (chunked uploads): a 20 MB JSON body would otherwise be read,
parsed and tokenized in full, costing every other client seconds and the process gigabytes. A JSON
body is then checked once for what would otherwise fail deep inside the server with no field to
blame: bytes that are not UTF-8, nesting deeper than MAX_JSON_DEPTH (chat templates, JSON-schema
compilers and Python's own parser recurse), and lone surrogates (`"\\ud800"`, valid JSON escapes
but no text: tokenizers raise on them). Each is a 400 naming the field (`param`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
# Levels of JSON objects and arrays a body may nest, the body itself being level 1. Real requests
# use under 10 (messages -> content parts -> text; tool schemas a few more).
MAX_JSON_DEPTH = 64
# A JSON escape of a UTF-16 surrogate: only bodies holding one can decode to a lone surrogate.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
# Methods whose body FastAPI parses.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


def _too_large_message(limit: int) -> str:
    return f"request body is larger than the server's limit of {limit} bytes (--max-request-bytes)"


class BodyError(ValueError):
    """A body refused before parsing: its HTTP status, message and the field to blame."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.code = code


def _is_json(scope: Scope) -> bool:
    # FastAPI's rule: no content type, or application/json or application/*+json, is parsed as JSON.
    value = dict(scope.get("headers") or []).get(b"content-type")
    if value is None:
        return True
    media = value.split(b";", 1)[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


def _dotted(path: tuple[str | int, ...]) -> str:
    return ".".join(str(p) for p in path)


def _children(value: dict[str, Any] | list[Any]) -> Iterator[tuple[str | int, Any]]:
    """The items of a container that can hold text: numbers (token lists) are skipped."""
    pairs = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in pairs:
        if isinstance(key, str):
            yield key, key  # keys are text too
        if isinstance(item, str | dict | list):
            yield key, item


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_json_value(body: Any) -> None:
    """Raise BodyError (400) naming the first field that nests deeper than MAX_JSON_DEPTH or holds
    a lone surrogate. Iterative: the value may nest as deep as the JSON parser allowed."""
    stack: list[tuple[tuple[str | int, ...], Any]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if _has_surrogate(value):
                where = _dotted(path) or "the body"
                raise BodyError(
                    400,
                    f"'{where}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), "
                    "which is not valid Unicode text",
                    _dotted(path) or None,
                )
            continue
        if not isinstance(value, dict | list):
            continue
        if len(path) >= MAX_JSON_DEPTH:
            field = str(path[0])
            raise BodyError(
                400,
                f"'{field}' nests JSON deeper than this server's limit of {MAX_JSON_DEPTH} levels "
                f"(at '{_dotted(path[:6])}...')",
                field,
            )
        stack.extend((path + (key,), item) for key, item in _children(value))


def check_json_body(raw: bytes) -> None:
    """Raise BodyError (400) if the body is not UTF-8, nests too deep, or holds a lone surrogate.
    Syntax errors are left to the framework's own parser (which names the position)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BodyError(400, f"request body is not valid UTF-8 (byte {e.start}: {e.reason})") from None
    # Cheap tests first: a body with no surrogate escape and fewer brackets than the depth limit
    # needs no walk (the common case, a few messages or a token list).
    if not _SURROGATE_ESCAPE.search(raw) and raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BodyError(
            400, f"request body nests JSON deeper than this server's limit of {MAX_JSON_DEPTH} levels"
        ) from None
    except ValueError:
        return  # malformed JSON: the framework's parser reports it with its position
    check_json_value(body)


class BodyLimitMiddleware:
    """Pure ASGI: reads a request's body within `max_bytes` (413 otherwise, without reading the
    rest), checks a JSON body with `check_json_body` (400), then hands the app the body it read.
    Errors are in OpenAI's shape, with `param` where a field is to blame."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_request_bytes must be > 0, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        try:
            body = await self._read(scope, receive)
            if body is None:
                return  # the client left before sending its whole body: nobody to answer
            if _is_json(scope) and body:
                check_json_body(body)
        except BodyError as e:
            await _refuse(send, e)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body, only the disconnect can come

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body; None if the client disconnected first."""
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            raise BodyError(413, _too_large_message(self.max_bytes), code="request_too_large")
        parts: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                raise BodyError(413, _too_large_message(self.max_bytes), code="request_too_large")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


async def _refuse(send: Send, error: BodyError) -> None:
    body = json.dumps(
        {
            "error": {
                "message": str(error),
                "type": "invalid_request_error",
                "param": error.param,
                "code": error.code,
            }
        },
        separators=(",", ":"),
    ).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if error.status == 413:
        headers.append((b"connection", b"close"))  # the rest of the body is not read
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
