"""The routes around generation: the models served, tokenization, re-publishing KV events for a
router, health and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse, Response

from chunkcache.server.context import Context, require_metrics_key
from chunkcache.server.errors import error_response
from chunkcache.server.protocol.admin import ModelCard, ModelList, TokenizeRequest, TokenizeResponse

# Behind the API key (build_app includes it with that dependency).
router = APIRouter()
# Open: load balancers probe health without a key; /metrics has its own guard.
open_router = APIRouter()


@router.get("/v1/models")
async def list_models(context: Context) -> ModelList:
    engine = context.engine
    cards = [
        ModelCard(
            id=name, created=context.started, root=engine.config.model, max_model_len=engine.max_model_len
        )
        for name in context.names
    ]
    return ModelList(data=cards)


@router.post("/kv_events/republish")
async def republish_kv_events(context: Context) -> Response:
    """Re-publish every cached block and chunk on the KV event socket: a router whose index lost
    its state (Redis restarted, history it could not replay) asks for this to rebuild it."""
    published = await context.engine_loop.call(context.engine.republish_state)
    if published is None:
        return error_response(409, "this server publishes no KV events", "invalid_request_error")
    return JSONResponse({"published_events": published})


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, context: Context) -> TokenizeResponse:
    context.resolve_model(body.model)
    engine, run_off_loop = context.engine, context.engine_loop.run_off_loop
    tokenizer = engine.tokenizer
    if body.messages is not None:
        messages = [m.to_template_message() for m in body.messages]
        text = await run_off_loop(
            lambda: engine.render_chat(messages, add_generation_prompt=body.add_generation_prompt)
        )
    else:
        assert body.prompt is not None
        text = body.prompt
    add_special = body.add_special_tokens
    if add_special is None:
        # Same defaults as generation: prompts get the special prefix, rendered chats carry their own.
        add_special = body.messages is None
    tokens = await run_off_loop(lambda: list(tokenizer.encode(text, add_special_tokens=add_special)))
    return TokenizeResponse(
        count=len(tokens),
        max_model_len=engine.max_model_len,
        tokens=tokens,
        token_strs=tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None,
    )


@open_router.get("/health")
async def health(context: Context) -> Response:
    if not context.engine_loop.alive:
        return error_response(503, "the engine is not running", "service_unavailable")
    return JSONResponse({"status": "ok"})


@open_router.get("/metrics", dependencies=[Depends(require_metrics_key)])
async def prometheus_metrics(context: Context) -> Response:
    if context.engine_loop.alive:
        context.metrics.update_engine_stats(await context.engine_loop.call(context.engine.stats))
    return Response(context.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
