"""The OpenAI-compatible HTTP application: one `ServerContext`, the middleware, and the routes of
server/routes/ (completions, chat, chunk cache, admin) behind the API key.

Errors are mapped to OpenAI's JSON shape in `server/errors.py`; streaming and the wait that gives
up on a disconnected client are in `server/streaming.py`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI

from chunkcache.http_limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from chunkcache.server.context import ServerContext, require_api_key
from chunkcache.server.engine_loop import EngineLoop
from chunkcache.server.errors import GuardMiddleware, install_error_handlers
from chunkcache.server.logprobs import LogprobWriter
from chunkcache.server.metrics import ServerMetrics
from chunkcache.server.prewarm_jobs import PrewarmJobs
from chunkcache.server.routes import admin, chat, chunk_cache, completions
from chunkcache.server.text_limits import DEFAULT_MAX_PREWARM_TOKENS, TextBound

if TYPE_CHECKING:
    from chunkcache.engine.engine import LLMEngine


def build_app(
    engine: LLMEngine,
    *,
    api_key: str | None,
    max_queue: int,
    served_model_name: str | Sequence[str] | None,
    drain_timeout: float | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    metrics_without_api_key: bool = False,
    max_prewarm_tokens: int = DEFAULT_MAX_PREWARM_TOKENS,
) -> FastAPI:
    """The application serving `engine`. The engine thread starts with the app's lifespan and, at
    shutdown, in-flight requests are drained (up to `drain_timeout` seconds) before the engine closes."""
    if max_prewarm_tokens <= 0:
        raise ValueError(f"max_prewarm_tokens must be > 0, got {max_prewarm_tokens}")
    names = _served_names(engine, served_model_name)
    metrics = ServerMetrics(model_name=names[0])
    context = ServerContext(
        engine=engine,
        engine_loop=EngineLoop(engine, max_queue=max_queue, metrics=metrics),
        metrics=metrics,
        names=names,
        started=int(time.time()),
        api_key=api_key,
        metrics_without_api_key=metrics_without_api_key,
        max_prewarm_tokens=max_prewarm_tokens,
        text_bound=_text_bound(engine),
        logprobs=LogprobWriter(engine.tokenizer),
        prewarm_jobs=PrewarmJobs(),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        context.engine_loop.start()
        try:
            yield
        finally:
            await context.prewarm_jobs.close()  # no client waits for them: not drained
            await context.engine_loop.shutdown(drain_timeout)

    app = FastAPI(title="chunkcache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.context = context
    app.state.engine_loop = context.engine_loop
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    app.add_middleware(GuardMiddleware, metrics=metrics)
    install_error_handlers(app)
    keyed = [Depends(require_api_key)]
    for module in (admin, completions, chat, chunk_cache):
        app.include_router(module.router, dependencies=keyed)
    app.include_router(admin.open_router)
    return app


def _served_names(engine: LLMEngine, served_model_name: str | Sequence[str] | None) -> tuple[str, ...]:
    """The model names the server answers to; the first is the default and the metrics' label."""
    if served_model_name is None:
        return (engine.model_name,)
    if isinstance(served_model_name, str):
        return (served_model_name,)
    return tuple(served_model_name) or (engine.model_name,)


def _text_bound(engine: LLMEngine) -> TextBound:
    """The bound that refuses text too long to fit before it is tokenized (server/text_limits.py)."""
    chunk = engine.config.chunk
    separator = chunk.separator if engine.chunks is not None else None
    return TextBound(engine.tokenizer, engine.max_model_len, separator, chunk.max_chunks)
