"""The chunk cache's own routes: its statistics, and prewarming (compute and cache a system part
and its documents without generating, docs/design.md §2)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from chunkcache.server.context import Context
from chunkcache.server.errors import CLIENT_CLOSED, ApiError
from chunkcache.server.prewarm_jobs import PrewarmJob, last_output, prewarm_response
from chunkcache.server.protocol.chunk_cache import PrewarmJobStatus, PrewarmRequest
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
    """Compute and cache a system part and its documents without generating (docs/design.md §2):
    answered when done, or at once with `"wait": false` (202, server/prewarm_jobs.py)."""
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
    if not body.wait:
        job = context.prewarm_jobs.start(stream)
        headers = {"Location": f"/v1/chunk_cache/prewarm/{job.id}"}
        return JSONResponse(job.status().model_dump(), status_code=202, headers=headers)
    try:
        out = await unless_disconnected(request, last_output(stream))
    finally:
        stream.release()
    if out is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(prewarm_response(request_id, out).model_dump())


@router.get("/v1/chunk_cache/prewarm/{prewarm_id}")
async def prewarm_status(prewarm_id: str, context: Context) -> PrewarmJobStatus:
    """The state of a prewarm started with `"wait": false`."""
    return _job(context.prewarm_jobs.get(prewarm_id), prewarm_id).status()


@router.delete("/v1/chunk_cache/prewarm/{prewarm_id}")
async def prewarm_cancel(prewarm_id: str, context: Context) -> PrewarmJobStatus:
    """Cancel a running prewarm (the documents it finished stay cached); its state after that."""
    job = _job(context.prewarm_jobs.cancel(prewarm_id), prewarm_id)
    if job.task is not None:
        await asyncio.wait({job.task})  # it has let go of the engine request
    return job.status()


def _job(job: PrewarmJob | None, prewarm_id: str) -> PrewarmJob:
    if job is None:
        raise ApiError(
            404,
            f'no prewarm {prewarm_id!r} (started with "wait": false) is known to this server',
            type="invalid_request_error",
            param="prewarm_id",
            code="not_found",
        )
    return job
