"""The OpenAI-compatible HTTP application: routes, authentication, streaming.

Errors are mapped to OpenAI's JSON shape in `server/errors.py`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from chunkcache.chunk.documents import PromptParts
from chunkcache.config import ReuseOptions
from chunkcache.errors import InvalidRequestError
from chunkcache.http_limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from chunkcache.outputs import CompletionOutput, RequestOutput
from chunkcache.sampling import SamplingParams
from chunkcache.server.choices import ChoiceGroup
from chunkcache.server.engine_loop import (
    EngineLoop,
    RequestFailedError,
    RequestStream,
    ShuttingDownError,
)
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
    DeltaToolCall,
    ModelCard,
    ModelList,
    NamedToolChoice,
    PrewarmRequest,
    PrewarmResponse,
    PromptTokensDetails,
    ResponseToolCall,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    Usage,
)
from chunkcache.server.text_limits import DEFAULT_MAX_PREWARM_TOKENS, TextBound
from chunkcache.server.tools import (
    HERMES_TAG,
    ToolCall,
    parse_hermes,
    parse_required_calls,
    template_speaks_hermes,
)

if TYPE_CHECKING:
    from chunkcache.engine.engine import LLMEngine

logger = logging.getLogger(__name__)


# (content, tool calls, whether the calls make the finish reason "tool_calls") of an answer's text.
ToolReader = Callable[[str], tuple[str | None, list[ToolCall], bool]]


class _EventStreamResponse(StreamingResponse):
    """SSE response that releases its request however the response ends: finished, failed or cut
    off by the client. Starlette may stop iterating without closing the generator, which would
    leave the request running (and its KV blocks allocated) until garbage collection."""

    def __init__(self, events: AsyncGenerator[str, None], stream: RequestStream | ChoiceGroup) -> None:
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


def _group_usage(finals: dict[int, RequestOutput], n: int) -> Usage:
    """Usage of a request's choices: each prompt counted once (from its choice 0), every choice's
    completion tokens summed, as OpenAI reports n > 1."""
    leads = [out for index, out in finals.items() if index % n == 0]
    prompt_tokens = sum(len(out.prompt_token_ids) for out in leads)
    completion_tokens = sum(len(out.outputs[0].token_ids) for out in finals.values())
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(out.num_cached_tokens for out in leads)),
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
    max_prewarm_tokens: int = DEFAULT_MAX_PREWARM_TOKENS,
) -> FastAPI:
    """The application serving `engine`. The engine thread starts with the app's lifespan and, at
    shutdown, in-flight requests are drained (up to `drain_timeout` seconds) before the engine closes."""
    if served_model_name is None:
        names: tuple[str, ...] = (engine.model_name,)
    elif isinstance(served_model_name, str):
        names = (served_model_name,)
    else:
        names = tuple(served_model_name) or (engine.model_name,)
    metrics = ServerMetrics(model_name=names[0])
    engine_loop = EngineLoop(engine, max_queue=max_queue, metrics=metrics)
    started = int(time.time())
    token_str = _TokenStrings(engine.tokenizer)
    if max_prewarm_tokens <= 0:
        raise ValueError(f"max_prewarm_tokens must be > 0, got {max_prewarm_tokens}")
    chunk = engine.config.chunk
    text_bound = TextBound(
        engine.tokenizer,
        engine.max_model_len,
        chunk.separator if engine.chunks is not None else None,
        chunk.max_chunks,
    )

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
        prompt: str | list[int] | PromptParts,
        params: SamplingParams,
        chunk_options: ReuseOptions | None,
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

    async def submit_group(
        prefix: str,
        prompts: list[str | list[int] | PromptParts],
        params: SamplingParams,
        n: int,
        chunk_options: ReuseOptions | None,
        add_special_tokens: bool = True,
        cache_salt: str | None = None,
    ) -> ChoiceGroup:
        def one(
            prompt: str | list[int] | PromptParts, choice_params: SamplingParams
        ) -> Awaitable[RequestStream]:
            return submit(prefix, prompt, choice_params, chunk_options, add_special_tokens, cache_salt)

        return await ChoiceGroup.start(one, prompts, params, n)

    async def collect_group(group: ChoiceGroup, request: Request) -> dict[int, RequestOutput] | None:
        """The final output of every choice of a non-streamed request, or None if the client went
        away first (everything is then aborted and its KV freed at once)."""

        async def last_outputs() -> dict[int, RequestOutput]:
            finals: dict[int, RequestOutput] = {}
            async for index, output in group.outputs():
                finals[index] = output
            return finals

        consumer = asyncio.ensure_future(last_outputs())
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if consumer.done():
                return consumer.result()
            return None
        finally:
            for task in (consumer, watcher):
                task.cancel()
            group.release()

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
            prompts = body.prompts()
        except ValueError as e:
            raise invalid(str(e), "prompt") from None
        for prompt in prompts:
            text_bound.check_prompt(prompt, "prompt")
        params = sampling_params(body)
        n = body.num_choices
        group = await submit_group(
            "cmpl", prompts, params, n, body.chunk_options(), cache_salt=body.cache_salt
        )
        k = body.logprobs
        echoes = [echo_text(p) for p in prompts] if body.echo else None
        if body.stream:
            return _EventStreamResponse(
                completion_events(group, model, k, body.include_usage_in_stream, echoes), group
            )
        finals = await collect_group(group, request)
        if finals is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for index in sorted(finals):
            final = finals[index]
            completion = final.outputs[0]
            logprobs = None
            if k is not None:
                logprobs, _ = completion_logprobs(
                    completion, 0, len(completion.token_ids), k, len(final.prompt or "")
                )
                if echoes is not None:
                    logprobs = echoed_prompt_logprobs(final, k).merged(logprobs)
            prefix = echoes[index // n] if echoes is not None else ""
            choices.append(
                CompletionChoice(
                    index=index,
                    text=prefix + completion.text,
                    logprobs=logprobs,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        response = CompletionResponse(
            id=group.request_id, model=model, choices=choices, usage=_group_usage(finals, n)
        )
        return JSONResponse(response.model_dump())

    def echo_text(prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else engine.tokenizer.decode(prompt)

    def echoed_prompt_logprobs(output: RequestOutput, k: int) -> CompletionLogprobs:
        """The prompt tokens in the completions logprobs format (the first has no logprob)."""
        result = CompletionLogprobs()
        entries = output.prompt_logprobs or []
        offset = 0
        for i, token_id in enumerate(output.prompt_token_ids):
            token = token_str(token_id)
            lp = entries[i] if i < len(entries) else None
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if lp is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(_finite(lp[token_id]))
            top = {token_str(t): v for t, v in _top(lp, k)}
            top.setdefault(token, _finite(lp[token_id]))
            result.top_logprobs.append(top)
        return result

    async def completion_events(
        group: ChoiceGroup, model: str, k: int | None, include_usage: bool, echoes: list[str] | None
    ) -> AsyncGenerator[str, None]:
        created = int(time.time())
        text_offsets: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        echoed: set[int] = set()
        try:
            async for index, output in group.outputs():
                finals[index] = output
                completion = output.outputs[0]
                logprobs = None
                if k is not None:
                    if index not in text_offsets:
                        text_offsets[index] = len(output.prompt or "")
                    end = len(completion.token_ids)
                    logprobs, text_offsets[index] = completion_logprobs(
                        completion, end - len(output.new_token_ids), end, k, text_offsets[index]
                    )
                text = output.new_text
                if echoes is not None and index not in echoed:
                    echoed.add(index)  # the prompt goes first, in the choice's first chunk
                    text = echoes[index // group.n] + text
                    if logprobs is not None:
                        logprobs = echoed_prompt_logprobs(output, k or 0).merged(logprobs)
                if not (text or output.finished or (logprobs and logprobs.tokens)):
                    continue
                chunk = CompletionChunk(
                    id=group.request_id,
                    created=created,
                    model=model,
                    choices=[
                        CompletionChoice(
                            index=index,
                            text=text,
                            logprobs=logprobs,
                            finish_reason=completion.finish_reason if output.finished else None,
                            stop_reason=completion.stop_reason if output.finished else None,
                        )
                    ],
                )
                yield _sse(chunk.model_dump_json())
        except RequestFailedError as e:
            yield _sse(stream_error(str(e), type="server_error", code="request_failed"))
        except ShuttingDownError as e:
            yield _sse(stream_error(str(e), code="server_shutting_down"))
        except Exception as e:  # the engine died, or a later choice was refused: say so in-stream
            yield _sse(stream_error(str(e)))
        else:
            if include_usage and finals:
                chunk = CompletionChunk(
                    id=group.request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=_group_usage(finals, group.n),
                )
                yield _sse(chunk.model_dump_json())
        yield _sse("[DONE]")

    @api.post("/v1/chat/completions", response_model=None)
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        model = resolve_model(body.model)
        params = sampling_params(body)
        # The rendered text goes through the same chunk parsing as any prompt (docs/design.md §2). As in
        # `LLM.chat` and vLLM, the template writes the special prefix (BOS) itself.
        tool_mode = body.tool_mode()
        if tool_mode == "auto" and not template_speaks_hermes(
            getattr(engine.tokenizer, "chat_template", None)
        ):
            raise invalid(
                "tool_choice 'auto' needs a chat template whose tool calls this server can read back "
                f"(the {HERMES_TAG} format of Qwen2.5, Qwen3 and Hermes); this model's template has none. "
                "Use tool_choice 'required' or a named function, which work with any model",
                "tool_choice",
            )
        messages, template_kwargs = body.template_messages(), body.template_kwargs()
        prompt = await engine_loop.run_off_loop(lambda: engine.render_chat(messages, **template_kwargs))
        text_bound.check_prompt(prompt, "messages")
        tool_names = {t.function.name for t in body.tools or []}

        def read_tools(text: str) -> tuple[str | None, list[ToolCall], bool]:
            """(content, tool calls, whether the calls replace the finish reason) of an answer."""
            if tool_mode == "named":
                assert isinstance(body.tool_choice, NamedToolChoice)
                return None, [ToolCall(body.tool_choice.function.name, text)], False
            if tool_mode == "required":
                return None, parse_required_calls(text), True
            if tool_mode == "auto":
                content, calls = parse_hermes(text, tool_names)
                return content, calls, bool(calls)
            return text, [], False

        n = body.num_choices
        try:
            group = await submit_group(
                "chatcmpl",
                [prompt],
                params,
                n,
                body.chunk_options(),
                add_special_tokens=False,
                cache_salt=body.cache_salt,
            )
        except InvalidRequestError as e:
            if e.param == "json_schema":  # the engine's name; the schema came from one of these fields
                e.param = "tools" if tool_mode in ("required", "named") else "response_format"
            raise
        k = (body.top_logprobs or 0) if body.logprobs else None
        reader = read_tools if tool_mode is not None else None
        if body.stream:
            return _EventStreamResponse(
                chat_events(group, model, k, body.include_usage_in_stream, reader), group
            )
        finals = await collect_group(group, request)
        if finals is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = []
        for index in sorted(finals):
            completion = finals[index].outputs[0]
            message, finish_reason = assistant_message(completion, reader)
            choices.append(
                ChatChoice(
                    index=index,
                    message=message,
                    logprobs=None
                    if k is None
                    else chat_logprobs(completion, 0, len(completion.token_ids), k),
                    finish_reason=finish_reason,
                    stop_reason=completion.stop_reason,
                )
            )
        response = ChatCompletionResponse(
            id=group.request_id, model=model, choices=choices, usage=_group_usage(finals, n)
        )
        return JSONResponse(response.model_dump())

    def assistant_message(
        completion: CompletionOutput, reader: ToolReader | None
    ) -> tuple[AssistantMessage, str | None]:
        """The answer as an assistant message, tool calls read back when tools are in use. A
        forced call cut short by max_tokens is not valid JSON: it stays text, finish "length"."""
        if reader is None or completion.finish_reason != "stop":
            return AssistantMessage(content=completion.text), completion.finish_reason
        try:
            content, calls, calls_finish = reader(completion.text)
        except ValueError:  # the JSON did not parse: the model's words are returned as they are
            return AssistantMessage(content=completion.text), completion.finish_reason
        message = AssistantMessage(
            content=content,
            tool_calls=[ResponseToolCall.model_validate(c.to_openai()) for c in calls] or None,
        )
        return message, "tool_calls" if calls_finish else completion.finish_reason

    async def chat_events(
        group: ChoiceGroup,
        model: str,
        k: int | None,
        include_usage: bool,
        reader: ToolReader | None = None,
    ) -> AsyncGenerator[str, None]:
        """With tools in use, a choice's text is held back and sent whole at its end, as content
        and tool_calls deltas (a call can only be read once complete)."""
        created = int(time.time())
        role_sent: set[int] = set()
        finals: dict[int, RequestOutput] = {}
        try:
            async for index, output in group.outputs():
                finals[index] = output
                completion = output.outputs[0]
                logprobs = None
                if k is not None and output.new_token_ids:
                    end = len(completion.token_ids)
                    logprobs = chat_logprobs(completion, end - len(output.new_token_ids), end, k)
                if not (output.new_text or output.finished or logprobs):
                    continue
                # OpenAI announces the role once per choice, in its first chunk.
                role = None if index in role_sent else "assistant"
                role_sent.add(index)
                finish_reason = completion.finish_reason if output.finished else None
                if reader is None:
                    delta = DeltaMessage(role=role, content=output.new_text)
                elif not output.finished:
                    if role is None:
                        continue  # nothing to say until the answer is complete
                    delta = DeltaMessage(role=role, content="")
                else:
                    message, finish_reason = assistant_message(completion, reader)
                    calls = [
                        DeltaToolCall.model_validate({**c.model_dump(), "index": i})
                        for i, c in enumerate(message.tool_calls or [])
                    ]
                    delta = DeltaMessage(role=role, content=message.content, tool_calls=calls or None)
                chunk = ChatCompletionChunk(
                    id=group.request_id,
                    created=created,
                    model=model,
                    choices=[
                        ChatChunkChoice(
                            index=index,
                            delta=delta,
                            logprobs=logprobs,
                            finish_reason=finish_reason,
                            stop_reason=completion.stop_reason if output.finished else None,
                        )
                    ],
                )
                yield _sse(chunk.model_dump_json(exclude_none=False))
        except RequestFailedError as e:
            yield _sse(stream_error(str(e), type="server_error", code="request_failed"))
        except ShuttingDownError as e:
            yield _sse(stream_error(str(e), code="server_shutting_down"))
        except Exception as e:  # the engine died, or a later choice was refused: say so in-stream
            yield _sse(stream_error(str(e)))
        else:
            if include_usage and finals:
                chunk = ChatCompletionChunk(
                    id=group.request_id,
                    created=created,
                    model=model,
                    choices=[],
                    usage=_group_usage(finals, group.n),
                )
                yield _sse(chunk.model_dump_json())
        yield _sse("[DONE]")

    @api.get("/v1/chunk_cache/stats")
    async def chunk_cache_stats() -> dict[str, Any]:
        stats = await engine_loop.call(engine.chunk_cache_stats)
        if stats is None:
            return {"enabled": False}
        return {"enabled": True, **stats}

    @api.post("/v1/chunk_cache/prewarm")
    async def prewarm(body: PrewarmRequest, request: Request) -> Response:
        """Compute and cache a system part and its documents without generating (docs/design.md §2)."""
        resolve_model(body.model)
        if body.prompt is not None:
            text_bound.check_total([body.prompt], max_prewarm_tokens, "prompt", "--max-prewarm-tokens")
        else:
            texts = [body.system or "", *(body.documents or [])]
            text_bound.check_total(texts, max_prewarm_tokens, "documents", "--max-prewarm-tokens")
        request_id = engine_loop.new_request_id("prewarm")
        stream = await engine_loop.submit_prewarm(
            request_id,
            prompt=body.prompt,
            system=body.system,
            documents=body.documents,
            cache_salt=body.cache_salt,
            max_tokens=max_prewarm_tokens,
        )

        async def last_output() -> RequestOutput:
            outputs = [out async for out in stream]
            return outputs[-1]

        consumer = asyncio.ensure_future(last_output())
        watcher = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not consumer.done():
                return Response(status_code=CLIENT_CLOSED)
            out = consumer.result()
        finally:
            for task in (consumer, watcher):
                task.cancel()
            stream.release()
        response = PrewarmResponse(
            id=request_id,
            prompt_tokens=len(out.prompt_token_ids),
            cached_tokens=out.num_cached_tokens,
            computed_tokens=out.num_computed_tokens,
        )
        return JSONResponse(response.model_dump())

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
