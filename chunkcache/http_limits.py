"""A cap on request body size, enforced before anything parses the body; shared by the server and
the router, so it lives outside both packages and imports nothing heavy (the router runs without torch).

A body larger than the cap is answered 413 at once when its Content-Length says so, and as soon as
the bytes read pass the cap otherwise (chunked uploads): a 20 MB JSON body would otherwise be read,
parsed and tokenized in full, costing every other client seconds and the process gigabytes.
"""

from __future__ import annotations

import json

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


def _too_large_message(limit: int) -> str:
    return f"request body is larger than the server's limit of {limit} bytes (--max-request-bytes)"


class BodyLimitMiddleware:
    """Pure ASGI: refuses bodies over `max_bytes` with HTTP 413 in OpenAI's error shape."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_request_bytes must be > 0, got {max_bytes}")
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > self.max_bytes
            except ValueError:
                too_large = False  # the server itself rejects a malformed Content-Length
            if too_large:
                await self._refuse(send)
                return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # Raised inside body reading: FastAPI passes HTTPExceptions through as they are.
                    raise HTTPException(413, _too_large_message(self.max_bytes))
            return message

        await self.app(scope, limited_receive, send)

    async def _refuse(self, send: Send) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": _too_large_message(self.max_bytes),
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "request_too_large",
                }
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
