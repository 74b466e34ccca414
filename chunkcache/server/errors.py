"""Errors in OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}`.

Every error the server sends goes through here: handled exceptions are mapped to their status,
unexpected ones are logged and answered with a generic 500, never a stack trace.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chunkcache.errors import InvalidRequestError, PromptTooLongError
from chunkcache.server.engine_loop import (
    EngineDeadError,
    QueueFullError,
    RequestFailedError,
    ShuttingDownError,
)
from chunkcache.server.metrics import ServerMetrics
from chunkcache.server.protocol.common import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

# Endpoints counted by name in the HTTP metrics; anything else is "other", so that scanners probing
# random paths cannot blow up the label cardinality.
API_PATHS = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/v1/chunk_cache/stats",
        "/tokenize",
        "/kv_events/republish",
        "/health",
        "/metrics",
    }
)
# Status code nginx made conventional for "client closed the connection before the answer".
CLIENT_CLOSED = 499


class ApiError(Exception):
    """An error answered to the client as-is, in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, *, type: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, type="invalid_request_error", param=param)


def param_named_in(message: str, fields: Sequence[str]) -> str | None:
    # SamplingParams and the engine start their messages with the offending field's name.
    head = message.split(" ", 1)[0].rstrip(":,")
    return head if head in fields else None


def _format_validation_errors(errors: Sequence[Any]) -> tuple[str, str | None]:
    """FastAPI's pydantic errors -> one message naming every bad field, and the first as `param`."""
    messages: list[str] = []
    params: list[str] = []
    seen: set[str] = set()
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        kind = err.get("type", "")
        if kind == "json_invalid":
            return f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        # Pydantic reports one error per union member under the same field; the first one suffices.
        field = loc[0] if loc else ""
        if field in seen:
            continue
        seen.add(field)
        dotted = ".".join(loc)
        if kind == "extra_forbidden":
            messages.append(f"unsupported field '{dotted}': this server does not implement it")
        elif kind == "missing":
            messages.append(f"missing required field '{dotted}'" if dotted else "request body is required")
        elif not loc:
            messages.append(str(err.get("msg", "")).removeprefix("Value error, "))
        else:
            messages.append(
                f"invalid value for '{dotted}': {str(err.get('msg', '')).removeprefix('Value error, ')}"
            )
        if dotted:
            params.append(dotted)
    return "; ".join(messages) or "invalid request", (params[0] if params else None)


class GuardMiddleware:
    """Counts responses by endpoint and status, and answers an unexpected exception with a plain
    500 in OpenAI's shape. Catching it here, rather than in Starlette's outermost error handler
    (which re-raises), keeps the connection alive: the server stays usable for that client.
    Pure ASGI, unlike BaseHTTPMiddleware, so it neither buffers streamed bodies nor hides client
    disconnects from the routes."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in API_PATHS else "other"
        status: int | None = None

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            logger.exception("unhandled error on %s %s", scope.get("method"), path)
            if status is not None:
                raise  # mid-response: nothing sane can be sent any more; the server drops the connection
            response = error_response(500, "internal server error; see the server log", "server_error")
            await response(scope, receive, send_wrapper)
        finally:
            self.metrics.observe_http(endpoint, status if status is not None else CLIENT_CLOSED)


def stream_error(message: str, type: str = "service_unavailable", code: str = "engine_dead") -> str:
    # Once a stream has started its status is 200; an error can only travel as an event.
    return json.dumps(ErrorResponse(error=ErrorInfo(message=message, type=type, code=code)).model_dump())


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _format_validation_errors(exc.errors())
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(PromptTooLongError)
    async def prompt_too_long(request: Request, exc: PromptTooLongError) -> JSONResponse:
        return error_response(
            400, str(exc), "invalid_request_error", exc.param or "prompt", "context_length_exceeded"
        )

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        response = error_response(503, str(exc), "service_unavailable", code="queue_full")
        response.headers["Retry-After"] = str(exc.retry_after)
        return response

    @app.exception_handler(RequestFailedError)
    async def request_failed(request: Request, exc: RequestFailedError) -> JSONResponse:
        return error_response(500, str(exc), "server_error", code="request_failed")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc), "service_unavailable", code="engine_unavailable")

    @app.exception_handler(ShuttingDownError)
    async def shutting_down(request: Request, exc: ShuttingDownError) -> JSONResponse:
        return error_response(503, str(exc), "service_unavailable", code="server_shutting_down")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)
