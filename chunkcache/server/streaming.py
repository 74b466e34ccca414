"""What every response over a running request shares: the SSE skeleton (chunks, then the error or
usage tail and `[DONE]`), the response class that frees the request however the stream ends, and
the wait that gives up when the client disconnects.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from typing import Protocol, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from chunkcache.outputs import RequestOutput
from chunkcache.server.choices import ChoiceGroup
from chunkcache.server.engine_loop import RequestFailedError, RequestStream, ShuttingDownError
from chunkcache.server.errors import stream_error
from chunkcache.server.protocol.common import PromptTokensDetails, Usage

T = TypeVar("T")


class EventStreamResponse(StreamingResponse):
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


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


def group_usage(finals: dict[int, RequestOutput], n: int) -> Usage:
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


class ChunkWriter(Protocol):
    """How one endpoint spells its stream: a chunk per output (None: nothing worth sending yet)
    and the final usage chunk."""

    def chunk(self, index: int, output: RequestOutput) -> BaseModel | None: ...

    def usage_chunk(self, usage: Usage) -> BaseModel: ...


async def stream_events(
    group: ChoiceGroup, writer: ChunkWriter, include_usage: bool
) -> AsyncGenerator[str, None]:
    """The SSE events of a streamed request: its chunks, then an in-stream error (the status line
    is long sent) or the usage chunk when asked, then `[DONE]` in every case."""
    finals: dict[int, RequestOutput] = {}
    try:
        async for index, output in group.outputs():
            finals[index] = output
            chunk = writer.chunk(index, output)
            if chunk is not None:
                yield sse(chunk.model_dump_json())
    except RequestFailedError as e:
        yield sse(stream_error(str(e), type="server_error", code="request_failed"))
    except ShuttingDownError as e:
        yield sse(stream_error(str(e), code="server_shutting_down"))
    except Exception as e:  # the engine died, or a later choice was refused: say so in-stream
        yield sse(stream_error(str(e)))
    else:
        if include_usage and finals:
            yield sse(writer.usage_chunk(group_usage(finals, group.n)).model_dump_json())
    yield sse("[DONE]")


async def _disconnected(request: Request) -> None:
    # The body is already read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client went away first (`work` is then cancelled; the
    caller releases its request so that its KV is freed at once)."""
    consumer = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if consumer.done():
            return consumer.result()
        return None
    finally:
        for task in (consumer, watcher):
            task.cancel()


async def collect_group(group: ChoiceGroup, request: Request) -> dict[int, RequestOutput] | None:
    """The final output of every choice of a non-streamed request, or None if the client went
    away first (everything is then aborted and its KV freed at once)."""

    async def last_outputs() -> dict[int, RequestOutput]:
        return {index: output async for index, output in group.outputs()}

    try:
        return await unless_disconnected(request, last_outputs())
    finally:
        group.release()
