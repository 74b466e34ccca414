"""An open backend response, relayed to the client: the part of proxying after the backend is chosen
(service.py chooses it and retries on another while nothing has reached the client)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import httpx

from chunkcache.router.backends import Backend

logger = logging.getLogger(__name__)


def sse_error_event(message: str) -> bytes:
    """An OpenAI-shaped error as one SSE event plus [DONE]; the blank line first ends whatever
    partial event the broken stream left behind."""
    error = {"error": {"message": message, "type": "backend_error", "param": None, "code": "backend_failed"}}
    return f"\n\ndata: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()


@dataclass
class Upstream:
    """An open backend response; it holds one unit of the backend's load until released."""

    resp: httpx.Response
    backend: Backend
    released: bool = False
    first: bytes = b""
    _chunks: AsyncIterator[bytes] | None = None

    async def prefetch(self, whole: bool) -> None:
        """Read the body (`whole`) or its first bytes, so that a backend failing before it sent
        anything fails here, where the request can still go elsewhere."""
        if whole:
            self.first = await self.resp.aread()
            return
        self._chunks = self.resp.aiter_raw()
        self.first = await anext(self._chunks, b"")

    async def relay(self, on_error: Callable[[BaseException], None] | None = None) -> AsyncIterator[bytes]:
        """The body, for a streamed response. A backend failing mid-stream ends it with an SSE
        error event (the status line is sent already), reported to `on_error`."""
        try:
            if self.first:
                yield self.first
            if self._chunks is None:
                self._chunks = self.resp.aiter_raw()
            try:
                async for chunk in self._chunks:
                    yield chunk
            except (httpx.TransportError, httpx.StreamError) as e:
                logger.warning("backend %s failed mid-stream: %s", self.backend.pod_id, e)
                if on_error is not None:
                    on_error(e)
                yield sse_error_event(f"the backend failed mid-stream: {type(e).__name__}: {e}")
        finally:
            await self.release()

    async def release(self) -> None:
        if not self.released:
            self.released = True
            self.backend.in_flight -= 1
            await self.resp.aclose()
