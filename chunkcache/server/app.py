"""The OpenAI-compatible HTTP application: routes, authentication, streaming.

Errors are mapped to OpenAI's JSON shape in `server/errors.py`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from chunkcache.outputs import CompletionOutput, RequestOutput
from chunkcache.sampling import SamplingParams
from chunkcache.server.engine_loop import EngineDeadError, EngineLoop, RequestFailedError, RequestStream
from chunkcache.server.errors import (
    CLIENT_CLOSED,
    ApiError,
    GuardMiddleware,
    error_response,
    install_error_handlers,
    invalid,
    param_named_in,
    stream_error,
)
from chunkcache.server.limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from chunkcache.server.metrics import ServerMetrics
from chunkcache.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    Usage,
)

if TYPE_CHECKING:
    from chunkcache.engine.engine import LLMEngine

logger = logging.getLogger(__name__)


class _EventStreamResponse(StreamingResponse):
    """SSE response that releases its request however the response ends: finished, failed or cut
    off by the client. Starlette may stop iterating without closing the generator, which would
    leave the request running (and its KV blocks allocated) until garbage collection."""

    def __init__(self, events: AsyncGenerator[str, None], stream: RequestStream) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._events = events
        self._request_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._request_stream.release()
            await self._events.aclose()


def _sse(payload: str) -> str:
    return f"data: {payload}\n\n"


class _TokenStrings:
    """Decoded text of single tokens, for logprobs; memoized because the vocabulary is finite and
    the same tokens recur across requests."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


# JSON has no infinity (Starlette refuses to encode it): an impossible token's logprob is sent as
# this floor instead, as vLLM does.
_LOGPROB_FLOOR = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, _LOGPROB_FLOOR)


def _top(entries: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely entries, as (token id, finite logprob), most likely first."""
    ranked = sorted(entries.items(), key=lambda kv: kv[1], reverse=True)[:k]
    return [(t, _finite(v)) for t, v in ranked]


def _usage(output: RequestOutput) -> Usage:
    prompt_tokens = len(output.prompt_token_ids)
    completion_tokens = len(output.outputs[0].token_ids)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=output.num_cached_tokens),
    )


def build_app(
    engine: LLMEngine,
    *,
    api_key: str | None,
    max_queue: int,
    served_model_name: str | Sequence[str] | None,
    drain_timeout: float | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    metrics_without_api_key: bool = False,
) -> FastAPI:
    """The application serving `engine`. The engine thread starts with the app's lifespan and, at
    shutdown, in-flight requests are drained (up to `drain_timeout` seconds) before the engine closes."""
    if served_model_name is None:
        names: tuple[str, ...] = (engine.model_name,)
    elif isinstance(served_model_name, str):
        names = (served_model_name,)
    else:
        names = tuple(served_model_name) or (engine.model_name,)
    metrics = ServerMetrics()
    engine_loop = EngineLoop(engine, max_queue=max_queue, metrics=metrics)
    started = int(time.time())
    token_str = _TokenStrings(engine.tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        try:
            yield
        finally:
            await engine_loop.shutdown(drain_timeout)

    app = FastAPI(title="chunkcache", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine_loop = engine_loop
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    app.add_middleware(GuardMiddleware, metrics=metrics)
    install_error_handlers(app)

    # ---- helpers bound to this server ------------------------------------------------------

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise ApiError(
                401,
                "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                type="invalid_request_error",
                code="invalid_api_key",
            )

    def resolve_model(name: str | None) -> str:
        if name is None:
            return names[0]
        if name not in names:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this server serves {list(names)}",
                type="invalid_request_error",
                param="model",
                code="model_not_found",
            )
        return name

    def sampling_params(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        try:
            return body.to_sampling_params()
        except ValueError as e:
            raise invalid(str(e), param_named_in(str(e), list(type(body).model_fields))) from None

    async def submit(
        prefix: str,
        prompt: str | list[int],
        params: SamplingParams,
        chunk_options: dict[str, Any] | None,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
    ) -> RequestStream:
        return await engine_loop.submit(
            engine_loop.new_request_id(prefix),
            prompt,
            params,
            add_special_tokens=add_special_tokens,
            chunk_options=chunk_options,
            cache_salt=cache_salt,
        )

    async def wait_for_disconnect(request: Request) -> None:
        # The body is already read, so the next ASGI message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def collect(stream: RequestStream, request: Request) -> RequestOutput | None:
        """The final output of a non-streamed request, or None if the client went away first
        (the request is then aborted and its KV freed right away, not when it would have ended)."""

        async def last_output() -> RequestOutput:
            final: RequestOutput | None = None
            async for output in stream:
                final = output
            assert final is not None
            return final

        consumer = asyncio.ensure_future(last_output())
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if consumer.done():
                return consumer.result()
            return None
        finally:
            for task in (consumer, watcher):
                task.cancel()
            stream.release()

    def completion_logprobs(
        completion: CompletionOutput, start: int, stop: int, k: int, text_offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """Logprobs of generated tokens [start, stop) in the completions format; also returns the
        text offset after them (offsets continue across streamed chunks)."""
        result = CompletionLogprobs()
        entries = completion.logprobs or []
        for i in range(start, stop):
            token_id = completion.token_ids[i]
            lp = entries[i] if i < len(entries) else {}
            token = token_str(token_id)
            result.tokens.append(token)
            sampled = lp.get(token_id)
            result.token_logprobs.append(None if sampled is None else _finite(sampled))
            top = {token_str(t): v for t, v in _top(lp, k)}
            if sampled is not None:
                top.setdefault(token, _finite(sampled))
            result.top_logprobs.append(top)
            result.text_offset.append(text_offset)
            text_offset += len(token)
        return result, text_offset

    def chat_logprobs(completion: CompletionOutput, start: int, stop: int, k: int) -> ChatLogprobs:
        content: list[ChatTokenLogprob] = []
        entries = completion.logprobs or []
        for i in range(start, stop):
            token_id = completion.token_ids[i]
            lp = entries[i] if i < len(entries) else {}
            token = token_str(token_id)
            content.append(
                ChatTokenLogprob(
                    token=token,
                    logprob=_finite(lp.get(token_id, _LOGPROB_FLOOR)),
                    bytes=list(token.encode()),
                    top_logprobs=[
                        TopLogprob(token=token_str(t), logprob=v, bytes=list(token_str(t).encode()))
                        for t, v in _top(lp, k)
                    ],
                )
            )
        return ChatLogprobs(content=content)

    # ---- routes ------------------------------------------------------------------------------

    api = APIRouter(dependencies=[Depends(check_api_key)])

    @api.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(
            data=[
                ModelCard(
                    id=name,
                    created=started,
                    root=engine.config.model,
                    max_model_len=engine.max_model_len,
                )
                for name in names
            ]
        )

    @api.post("/v1/completions", response_model=None)
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        model = resolve_model(body.model)
        try:
            prompt = body.single_prompt()
        except ValueError as e:
            raise invalid(str(e), "prompt") from None
        params = sampling_params(body)
        stream = await submit("cmpl", prompt, params, body.chunk_options(), cache_salt=body.cache_salt)
        k = body.logprobs
        if body.stream:
            return _EventStreamResponse(
                completion_events(stream, model, k, body.include_usage_in_stream), stream
            )
        final = await collect(stream, request)
        if final is None:
            return Response(status_code=CLIENT_CLOSED)
        completion = final.outputs[0]
        logprobs = None
        if k is not None:
            logprobs, _ = completion_logprobs(
                completion, 0, len(completion.token_ids), k, len(final.prompt or "")
            )
        response = CompletionResponse(
            id=stream.request_id,
            model=model,
            choices=[
                CompletionChoice(
                    text=completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            ],
            usage=_usage(final),
        )
        return JSONResponse(response.model_dump())

    async def completion_events(
        stream: RequestStream, model: str, k: int | None, include_usage: bool
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        text_offset: int | None = None
        final: RequestOutput | None = None
        try:
            async for output in stream:
                final = output
                completion = output.outputs[0]
                logprobs = None
                if k is not None:
                    if text_offset is None:
                        text_offset = len(output.prompt or "")
                    end = len(completion.token_ids)
                    logprobs, text_offset = completion_logprobs(
                        completion, end - len(output.new_token_ids), end, k, text_offset
                    )
                if not (output.new_text or output.finished or (logprobs and logprobs.tokens)):
                    continue
                chunk = CompletionChunk(
                    id=stream.request_id,
                    created=created,
                    model=model,
                    choices=[
                        CompletionChoice(
                            text=output.new_text,
                            logprobs=logprobs,
                            finish_reason=completion.finish_reason if output.finished else None,
                            stop_reason=completion.stop_reason if output.finished else None,
                        )
                    ],
                )
                yield _sse(chunk.model_dump_json())
        except EngineDeadError as e:
            yield _sse(stream_error(str(e)))
        except RequestFailedError as e:
            yield _sse(stream_error(str(e), type="server_error", code="request_failed"))
        else:
            if include_usage and final is not None:
                chunk = CompletionChunk(
                    id=stream.request_id, created=created, model=model, choices=[], usage=_usage(final)
                )
                yield _sse(chunk.model_dump_json())
        yield _sse("[DONE]")

    @api.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        model = resolve_model(body.model)
        params = sampling_params(body)
        # The rendered text goes through the same chunk parsing as any prompt (DESIGN.md §2). As in
        # `LLM.chat` and vLLM, the template writes the special prefix (BOS) itself.
        messages = body.template_messages()
        prompt = await engine_loop.run_off_loop(
            lambda: engine.render_chat(messages, add_generation_prompt=True)
        )
        stream = await submit(
            "chatcmpl",
            prompt,
            params,
            body.chunk_options(),
            add_special_tokens=False,
            cache_salt=body.cache_salt,
        )
        k = (body.top_logprobs or 0) if body.logprobs else None
        if body.stream:
            return _EventStreamResponse(chat_events(stream, model, k, body.include_usage_in_stream), stream)
        final = await collect(stream, request)
        if final is None:
            return Response(status_code=CLIENT_CLOSED)
        completion = final.outputs[0]
        response = ChatCompletionResponse(
            id=stream.request_id,
            model=model,
            choices=[
                ChatChoice(
                    message=AssistantMessage(content=completion.text),
                    logprobs=None
                    if k is None
                    else chat_logprobs(completion, 0, len(completion.token_ids), k),
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            ],
            usage=_usage(final),
        )
        return JSONResponse(response.model_dump())

    async def chat_events(
        stream: RequestStream, model: str, k: int | None, include_usage: bool
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        role_sent = False
        final: RequestOutput | None = None
        try:
            async for output in stream:
                final = output
                completion = output.outputs[0]
                logprobs = None
                if k is not None and output.new_token_ids:
                    end = len(completion.token_ids)
                    logprobs = chat_logprobs(completion, end - len(output.new_token_ids), end, k)
                if not (output.new_text or output.finished or logprobs):
                    continue
                # OpenAI announces the role once, in the first chunk.
                delta = DeltaMessage(role=None if role_sent else "assistant", content=output.new_text)
                role_sent = True
                chunk = ChatCompletionChunk(
                    id=stream.request_id,
                    created=created,
                    model=model,
                    choices=[
                        ChatChunkChoice(
                            delta=delta,
                            logprobs=logprobs,
                            finish_reason=completion.finish_reason if output.finished else None,
                            stop_reason=completion.stop_reason if output.finished else None,
                        )
                    ],
                )
                yield _sse(chunk.model_dump_json(exclude_none=False))
        except EngineDeadError as e:
            yield _sse(stream_error(str(e)))
        except RequestFailedError as e:
            yield _sse(stream_error(str(e), type="server_error", code="request_failed"))
        else:
            if include_usage and final is not None:
                chunk = ChatCompletionChunk(
                    id=stream.request_id, created=created, model=model, choices=[], usage=_usage(final)
                )
                yield _sse(chunk.model_dump_json())
        yield _sse("[DONE]")

    @api.get("/v1/chunk_cache/stats")
    async def chunk_cache_stats() -> dict[str, Any]:
        stats = await engine_loop.call(engine.chunk_cache_stats)
        if stats is None:
            return {"enabled": False}
        return {"enabled": True, **stats}

    @api.post("/kv_events/republish")
    async def republish_kv_events() -> Response:
        """Re-publish every cached block and chunk on the KV event socket: a router whose index lost
        its state (Redis restarted, history it could not replay) asks for this to rebuild it."""
        published = await engine_loop.call(engine.republish_state)
        if published is None:
            return error_response(409, "this server publishes no KV events", "invalid_request_error")
        return JSONResponse({"published_events": published})

    @api.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        resolve_model(body.model)
        tokenizer = engine.tokenizer
        if body.messages is not None:
            messages = [m.to_template_message() for m in body.messages]
            text = await engine_loop.run_off_loop(
                lambda: engine.render_chat(messages, add_generation_prompt=body.add_generation_prompt)
            )
        else:
            assert body.prompt is not None
            text = body.prompt
        add_special = body.add_special_tokens
        if add_special is None:
            # Same defaults as generation: prompts get the special prefix, rendered chats carry their own.
            add_special = body.messages is None
        tokens = await engine_loop.run_off_loop(
            lambda: list(tokenizer.encode(text, add_special_tokens=add_special))
        )
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=engine.max_model_len,
            tokens=tokens,
            token_strs=tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
        )

    app.include_router(api)

    @app.get("/health")
    async def health() -> Response:
        if not engine_loop.alive:
            return error_response(503, "the engine is not running", "service_unavailable")
        return JSONResponse({"status": "ok"})

    # Cached-token counts tell one tenant about another's traffic: behind the key unless asked.
    metrics_guard = [] if metrics_without_api_key else [Depends(check_api_key)]

    @app.get("/metrics", dependencies=metrics_guard)
    async def prometheus_metrics() -> Response:
        if engine_loop.alive:
            metrics.update_engine_stats(await engine_loop.call(engine.stats))
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
