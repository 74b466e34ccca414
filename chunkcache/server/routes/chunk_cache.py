"""The chunk cache's own routes: its statistics, and prewarming (compute and cache a system part
and its documents without generating, docs/design.md §2)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from chunkcache.outputs import RequestOutput
from chunkcache.server.context import Context
from chunkcache.server.engine_loop import RequestStream
from chunkcache.server.errors import CLIENT_CLOSED
from chunkcache.server.protocol import PrewarmRequest, PrewarmResponse
from chunkcache.server.streaming import unless_disconnected

router = APIRouter()


@router.get("/v1/chunk_cache/stats")
async def chunk_cache_stats(context: Context) -> dict[str, Any]:
    stats = await context.engine_loop.call(context.engine.chunk_cache_stats)
    if stats is None:
        return {"enabled": False}
    return {"enabled": True, **stats}


@router.post("/v1/chunk_cache/prewarm")
async def prewarm(body: PrewarmRequest, request: Request, context: Context) -> Response:
    """Compute and cache a system part and its documents without generating (docs/design.md §2)."""
    context.resolve_model(body.model)
    limit = context.max_prewarm_tokens
    if body.prompt is not None:
        context.text_bound.check_total([body.prompt], limit, "prompt", "--max-prewarm-tokens")
    else:
        texts = [body.system or "", *(body.documents or [])]
        context.text_bound.check_total(texts, limit, "documents", "--max-prewarm-tokens")
    request_id = context.engine_loop.new_request_id("prewarm")
    stream = await context.engine_loop.submit_prewarm(
        request_id,
        prompt=body.prompt,
        system=body.system,
        documents=body.documents,
        cache_salt=body.cache_salt,
        max_tokens=limit,
    )
    try:
        out = await unless_disconnected(request, _last_output(stream))
    finally:
        stream.release()
    if out is None:
        return Response(status_code=CLIENT_CLOSED)
    response = PrewarmResponse(
        id=request_id,
        prompt_tokens=len(out.prompt_token_ids),
        cached_tokens=out.num_cached_tokens,
        computed_tokens=out.num_computed_tokens,
    )
    return JSONResponse(response.model_dump())


async def _last_output(stream: RequestStream) -> RequestOutput:
    outputs = [out async for out in stream]
    return outputs[-1]
