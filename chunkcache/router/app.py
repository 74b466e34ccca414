"""`chunkcache route`: the cache-aware router as an OpenAI-compatible HTTP proxy.

Endpoints: POST /v1/completions and /v1/chat/completions (proxied, SSE streamed through),
GET /v1/models (from any healthy backend), POST /score (per-pod scores of a prompt or messages),
GET /health, GET /metrics.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from chunkcache import envs
from chunkcache.config import DEFAULT_DOCUMENTS_FORMAT, HASH_ALGORITHMS
from chunkcache.errors import UsageError, add_debug_argument, run_command
from chunkcache.http_limits import DEFAULT_MAX_REQUEST_BYTES, BodyLimitMiddleware
from chunkcache.model import catalog
from chunkcache.model.source import default_model_name, resolve_model_path
from chunkcache.router.backends import BackendSpec, load_backends_file, parse_backend_list
from chunkcache.router.config import RouterConfig
from chunkcache.router.discovery import add_discovery_arguments, discovery_from_args
from chunkcache.router.policy import DEFAULT_CACHE_THRESHOLD, POLICIES
from chunkcache.router.scorer import parse_tier_weights
from chunkcache.router.service import NoBackendError, Router

logger = logging.getLogger(__name__)

# Hop-by-hop and length headers are the proxy's own business on each leg.
_FORWARD_HEADERS = ("content-type", "authorization", "accept", "x-request-id", "openai-organization")


def _error(
    status: int, message: str, kind: str = "invalid_request_error", code: str | None = None
) -> JSONResponse:
    """An error in OpenAI's shape: `code` is a string naming the error (or null), as OpenAI's is."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status_code=status)


def create_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.close()

    docs = router.config.serve_docs
    app = FastAPI(
        title="chunkcache router",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.router = router

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and methods: OpenAI's shape too, not FastAPI's {"detail": ...}.
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind)

    app.add_middleware(BodyLimitMiddleware, max_bytes=router.config.max_request_bytes)
    api_key = router.config.api_key

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Any) -> Response:
        refused = _key_refusal(request, api_key, router.config.open_metrics)
        return refused if refused is not None else await call_next(request)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _proxy(router, request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _proxy(router, request, "/v1/chat/completions", chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await _models(router, request)

    @app.post("/score")
    async def score(request: Request) -> Response:
        try:
            body = await request.json()
            chat = isinstance(body, dict) and "messages" in body
            prompt, rendered = router.prompt_of(body, chat)
        except ValueError as e:
            return _error(400, str(e))
        result = await run_in_threadpool(
            router.score_prompt, prompt, rendered, router.lora_of(body), router.salt_of(body)
        )
        if result.scores is None:
            return _error(503, "the index is unavailable", "service_unavailable", "index_unavailable")
        scores = {
            pod: {
                "prefix_blocks": s.prefix_blocks,
                "prefix_tokens": s.prefix_tokens,
                "chunk_tokens": s.chunk_tokens,
                "score": s.total(True),
                "prefix_only_score": s.total(False),
            }
            for pod, s in result.scores.items()
        }
        return JSONResponse(
            {
                "num_tokens": result.num_tokens,
                "num_blocks": result.num_blocks,
                "num_chunks": result.num_chunks,
                "scores": scores,
            }
        )

    @app.get("/health")
    async def health() -> Response:
        backends = {b.pod_id: b.healthy for b in router.pool}
        ok = any(backends.values())
        return JSONResponse(
            {"status": "ok" if ok else "no_healthy_backend", "backends": backends}, 200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> Response:
        # Off the event loop: the index size is a Redis round trip when the index is in Redis.
        return Response(await run_in_threadpool(router.metrics.render), media_type=CONTENT_TYPE_LATEST)

    return app


def _key_refusal(request: Request, api_key: str | None, open_metrics: bool) -> JSONResponse | None:
    """The 401 for a request without the router's key, or None to let it through. Everything but
    /health needs the key when one is set: /score tells which documents a pod holds, /metrics
    what traffic it had (left open by --metrics-without-api-key: `open_metrics`)."""
    path = request.url.path
    open_paths = {"/health"} | ({"/metrics"} if open_metrics else set())
    if api_key is None or path in open_paths:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return _error(
            401,
            "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
            code="invalid_api_key",
        )
    return None


async def _proxy(router: Router, request: Request, path: str, chat: bool) -> Response:
    """A completion request forwarded to the backend `router` picks, streamed through when the
    body asks for a stream; an invalid body is a 400, no backend or a failed one an error in
    OpenAI's shape naming which."""
    raw = await request.body()
    try:
        body = json.loads(raw)
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
    except ValueError as e:
        return _error(400, f"invalid JSON body: {e}")
    headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
    stream = bool(body.get("stream"))
    try:
        up = await router.forward(path, body, raw, headers, chat, stream=stream)
    except NoBackendError as e:
        return _error(e.status, str(e), "backend_unavailable", "no_backend")
    except httpx.HTTPError as e:
        router.metrics.requests_failed.inc()
        return _error(
            502, f"backend request failed: {type(e).__name__}: {e}", "backend_error", "backend_failed"
        )
    out_headers = {"x-chunkcache-backend": up.backend.pod_id}
    media_type = up.resp.headers.get("content-type")
    if stream:

        def failed_mid_stream(error: BaseException) -> None:
            router.metrics.requests_failed.inc()
            router.metrics.proxy_errors.labels(up.backend.pod_id).inc()

        return StreamingResponse(up.relay(failed_mid_stream), up.resp.status_code, out_headers, media_type)
    await up.release()
    return Response(up.first, up.resp.status_code, out_headers, media_type)


async def _models(router: Router, request: Request) -> Response:
    """GET /v1/models as the first candidate backend that answers gives it; 503 while discovery
    has found no pod, 502 when none answered."""
    assert router.client is not None
    headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
    for b in router.pool.candidates():
        try:
            resp = await router.client.get(
                f"{b.url}/v1/models", headers=headers, timeout=router.config.health_timeout_s
            )
        except httpx.HTTPError:
            continue
        return Response(resp.content, resp.status_code, media_type=resp.headers.get("content-type"))
    if not len(router.pool):
        return _error(
            503, "no backend yet: discovery found no ready pod", "backend_unavailable", "no_backend"
        )
    return _error(502, "no backend answered /v1/models", "backend_unavailable", "no_backend")


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("backends")
    g.add_argument(
        "--backends",
        action="append",
        default=[],
        metavar="SPEC[,SPEC...]",
        help="backends as [NAME@]URL[=EVENTS[=REPLAY]], e.g. http://127.0.0.1:8001=tcp://127.0.0.1:5557",
    )
    g.add_argument(
        "--backend", dest="backends", action="append", metavar="SPEC", help="one backend (repeatable)"
    )
    g.add_argument("--backends-file", help="file of backend specs, one per line, or JSON")
    g.add_argument(
        "--health-interval", type=float, default=5.0, help="seconds between health checks (0: off)"
    )
    g.add_argument("--request-timeout", type=float, default=600.0, help="seconds a proxied request may take")
    add_discovery_arguments(parser)
    g = parser.add_argument_group("prompts")
    g.add_argument(
        "--model",
        default=None,
        help="what the replicas serve, as `chunkcache serve --model` takes it (a .gguf file, a checkpoint "
        "directory or a short name; default: the default model): its tokenizer and chat template are the "
        "router's, and its name the default --model-name",
    )
    g.add_argument("--tokenizer", default=None, help="override: a local tokenizer directory or .gguf file")
    g.add_argument(
        "--model-name",
        default=None,
        help="the engines' model name, part of every chunk key (default: the name `chunkcache serve "
        "--model` gives the same model: the GGUF file's stem or the directory's name; give the replicas' "
        "--served-model-name if they set one)",
    )
    g.add_argument("--chunk-separator", default=" # # ")
    g.add_argument("--chunk-hash-algorithm", default="sha256", choices=HASH_ALGORITHMS)
    g.add_argument("--no-chunks", action="store_true", help="score chunked prompts as plain prompts")
    g.add_argument(
        "--documents-format",
        default=DEFAULT_DOCUMENTS_FORMAT,
        help="the engines' --documents-format: how chat `documents` are written when the chat "
        "template does not render them (default: %(default)r)",
    )
    g.add_argument("--block-size", type=int, default=16, help="the router's block size in tokens")
    g.add_argument("--lora-names", default="", help="comma-separated request models that are LoRA adapters")
    g = parser.add_argument_group("index and events")
    g.add_argument("--index", default="memory", help="'memory' or redis://host:port/db (shared by routers)")
    g.add_argument("--index-capacity", type=int, default=10_000_000, help="block keys (memory index)")
    g.add_argument("--pods-per-key", type=int, default=10)
    g.add_argument("--events-bind", help="bind one SUB socket that pods connect to, e.g. tcp://*:5557")
    g.add_argument("--events-topic-filter", default="", help="ZMQ topic prefix to subscribe to, e.g. kv@")
    g.add_argument("--event-workers", type=int, default=4)
    g.add_argument(
        "--events-insecure",
        action="store_true",
        help="let --events-bind bind a non-loopback address without CURVE keys (anyone who reaches "
        "it can forge events); otherwise a wildcard binds 127.0.0.1 and other addresses are refused",
    )
    g.add_argument(
        "--events-curve-secret-key",
        help="ZMQ CURVE: the router's secret certificate file (zmq.auth format, '.key_secret')",
    )
    g.add_argument(
        "--events-curve-backend-keys",
        help="ZMQ CURVE: directory of the backends' public keys, one '<backend name>.key' each",
    )
    g = parser.add_argument_group("routing")
    g.add_argument("--policy", default="cache_aware", choices=POLICIES)
    g.add_argument(
        "--load-weight", type=float, default=0.5, help="how much in-flight load offsets a cache hit"
    )
    g.add_argument(
        "--cache-threshold",
        type=float,
        default=DEFAULT_CACHE_THRESHOLD,
        help="a prompt no backend holds this share of (0..1) goes to the least loaded backend, so that new "
        "content spreads over the backends' caches (SGLang's router uses 0.5); 0: only when none holds any "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--tier-weights",
        default="gpu=1.0,cpu=0.8,disk=0.3,remote=0.3",
        help="score weight per KV tier (the `medium` of KV events), each in [0, 1]; a tier not named keeps "
        "its default; a chunk in the shared remote tier counts for every backend that shares it "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--remote-tier-backends",
        default=None,
        help="comma-separated backend names that share one remote chunk tier (their engines' "
        "--chunk-cache-remote); default: all backends",
    )
    g.add_argument("--seed", type=int, default=None, help="seed of the random policy")
    g = parser.add_argument_group("security")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer <key>' on every route but /health; forwarded to backends",
    )
    g.add_argument("--metrics-without-api-key", action="store_true", help="leave /metrics open for scrapers")
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get HTTP 413 before they are read (default: %(default)s)",
    )
    g.add_argument(
        "--backend-api-key",
        default=None,
        help="key for the router's own calls to backends (state re-publishing; default: --api-key)",
    )
    g.add_argument("--serve-docs", action="store_true", help="serve /docs and /openapi.json (off by default)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8080)


def _remote_pods(spec: str | None, backends: list[BackendSpec], discover: bool) -> tuple[str, ...] | None:
    if spec is None:
        return None
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    known = {b.pod_id for b in backends}
    unknown = sorted(set(names) - known)
    if unknown and not discover:  # discovered pods are named only once they appear
        raise UsageError(f"--remote-tier-backends names unknown backends {unknown}; known: {sorted(known)}")
    return names


def _model_source(model: str | None, tokenizer: str | None, model_name: str | None) -> tuple[str, str]:
    """(tokenizer path, model name): from the model the replicas serve, resolved as `serve` resolves
    it (so that both agree on the chunk keys' model name), unless both are given."""
    if tokenizer is not None and model_name is not None:
        return tokenizer, model_name
    path = resolve_model_path(model or catalog.DEFAULT_MODEL)
    return tokenizer or str(path), model_name or default_model_name(path)


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    specs = parse_backend_list(args.backends or [])
    if args.backends_file:
        specs += load_backends_file(args.backends_file)
    discovery = discovery_from_args(args)
    if not specs and discovery is None:
        raise UsageError("give --backends, --backends-file or --discover-pods")
    tokenizer, model_name = _model_source(args.model, args.tokenizer, args.model_name)
    return RouterConfig(
        backends=tuple(specs),
        model_name=model_name,
        tokenizer=tokenizer,
        index=args.index,
        index_capacity=args.index_capacity,
        pods_per_key=args.pods_per_key,
        policy=args.policy,
        load_weight=args.load_weight,
        cache_threshold=args.cache_threshold,
        tier_weights=parse_tier_weights(args.tier_weights),
        block_size=args.block_size,
        chunk_separator=args.chunk_separator,
        chunk_hash_algorithm=args.chunk_hash_algorithm,
        enable_chunks=not args.no_chunks,
        documents_format=args.documents_format,
        lora_names=tuple(n for n in args.lora_names.split(",") if n),
        remote_pods=_remote_pods(args.remote_tier_backends, specs, discovery is not None),
        events_bind=args.events_bind,
        events_topic_filter=args.events_topic_filter,
        event_workers=args.event_workers,
        health_interval_s=args.health_interval,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
        api_key=args.api_key,
        open_metrics=args.metrics_without_api_key,
        events_curve_secret_key=args.events_curve_secret_key,
        events_curve_backend_keys=args.events_curve_backend_keys,
        events_insecure=args.events_insecure,
        serve_docs=args.serve_docs,
        backend_api_key=args.backend_api_key,
        max_request_bytes=args.max_request_bytes,
        discovery=discovery,
    )


def run_route(args: argparse.Namespace) -> int:
    import uvicorn  # only the command line needs a server

    logging.basicConfig(level=envs.log_level(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        router = Router(config_from_args(args))
    except ValueError as e:  # a malformed backend spec or tier weight, a tokenizer that will not load
        raise UsageError(str(e)) from e
    app = create_app(router)
    uvicorn.run(app, host=args.host, port=args.port, log_level=envs.log_level().lower())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="chunkcache route", description=__doc__.splitlines()[0])
    add_route_arguments(parser)
    add_debug_argument(parser)
    args = parser.parse_args(argv)
    return run_command(parser.prog, lambda: run_route(args), args.debug)
