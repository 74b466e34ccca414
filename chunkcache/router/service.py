"""The router's moving parts wired together: prompt -> keys -> scores -> backend -> proxied request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.concurrency import run_in_threadpool

from chunkcache.chunk.documents import PromptParts
from chunkcache.curve import CurveKeys
from chunkcache.router.backends import Backend, BackendPool, BackendSpec
from chunkcache.router.config import RouterConfig, open_index
from chunkcache.router.discovery import PodWatcher, connect
from chunkcache.router.events import EventIntake, IntakeCurve
from chunkcache.router.index import IndexUnavailableError, KVIndex
from chunkcache.router.metrics import RouterMetrics
from chunkcache.router.policy import Decision, Picker
from chunkcache.router.scorer import PodScore, Scorer, ScorerConfig
from chunkcache.router.tokens import BlockKeyer, PromptProcessor
from chunkcache.router.upstream import Upstream

logger = logging.getLogger(__name__)


@dataclass
class ScoreResult:
    scores: dict[str, PodScore] | None  # None: the index could not be asked
    num_tokens: int = 0
    num_blocks: int = 0
    num_chunks: int = 0
    tokenize_s: float = 0.0
    score_s: float = 0.0


class NoBackendError(RuntimeError):
    """No backend to send a request to: 503 when there is none at all (discovery found no ready
    pod yet), 502 when every one refused it."""

    def __init__(self, message: str, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class Router:
    def __init__(
        self,
        config: RouterConfig,
        processor: PromptProcessor | None = None,
        index: KVIndex | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.config = config
        # Before the tokenizer loads: a missing Kubernetes configuration is a quick, one-line error.
        kube = None if config.discovery is None else connect(config.discovery)
        keyer = BlockKeyer(config.block_size)
        if processor is None:
            if config.tokenizer is None:
                raise ValueError("a router needs --model or --tokenizer (the served model's tokenizer)")
            processor = PromptProcessor.from_pretrained(
                config.tokenizer,
                config.model_name,
                keyer=keyer,
                separator=config.chunk_separator,
                chunk_hash_algorithm=config.chunk_hash_algorithm,
                enable_chunks=config.enable_chunks,
                documents_format=config.documents_format,
            )
        self.processor = processor
        self.index = index or open_index(config.index, config.index_capacity, config.pods_per_key)
        remote_pods = None if config.remote_pods is None else frozenset(config.remote_pods)
        self.scorer = Scorer(
            self.index,
            ScorerConfig(config.tier_weights, block_size=config.block_size, remote_pods=remote_pods),
        )
        self.pool = BackendPool(config.backends, allow_empty=config.discovery is not None)
        self.picker = Picker(config.policy, config.load_weight, config.seed, config.cache_threshold)
        self.discovery: PodWatcher | None = None
        if config.discovery is not None and kube is not None:
            self.discovery = PodWatcher(config.discovery, *kube, self._discovered)
        self.intake: EventIntake | None = None
        discovered_events = config.discovery is not None and config.discovery.events_port is not None
        if config.events_bind is not None or discovered_events or any(s.events for s in config.backends):
            curve = None
            if config.events_curve_secret_key is not None or config.events_curve_backend_keys is not None:
                if config.events_curve_secret_key is None or config.events_curve_backend_keys is None:
                    raise ValueError(
                        "CURVE needs both the router's secret key and the backends' key directory"
                    )
                curve = IntakeCurve(
                    CurveKeys.load(config.events_curve_secret_key), config.events_curve_backend_keys
                )
            self.intake = EventIntake(
                self.index,
                self.processor.keyer,
                num_workers=config.event_workers,
                topic_filter=config.events_topic_filter,
                bind_endpoint=config.events_bind,
                replay_timeout_s=config.replay_timeout_s,
                # Only backends may publish into the index (discovered ones while they are).
                allowed_pods=[spec.pod_id for spec in config.backends],
                curve=curve,
                insecure=config.events_insecure,
                on_clear=self._on_pod_cleared,
                tier_weights=config.tier_weights,
            )
        self.metrics = RouterMetrics(self.index, self.pool, lambda: self.intake, self.discovery)
        self._transport = transport
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._resyncing: set[str] = set()
        self._resync_tasks: set[asyncio.Task[None]] = set()
        self.resyncs = 0  # state re-publications asked of backends
        self._index_down_until = 0.0

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self.intake is not None:
            for spec in self.config.backends:
                self.intake.add_pod(spec.pod_id, spec.events, spec.replay)
            self.intake.start()
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
        self.client = httpx.AsyncClient(transport=self._transport, limits=limits, timeout=None)
        self._loop = asyncio.get_running_loop()
        if self.config.health_interval_s > 0:
            self._health_task = asyncio.create_task(
                self.pool.health_loop(
                    self.client, self.config.health_interval_s, self.config.health_timeout_s
                )
            )
            if self.intake is not None:
                self._watch_task = asyncio.create_task(self._watch_index(self.config.health_interval_s))
        if self.discovery is not None:
            self.discovery.start()

    async def close(self) -> None:
        if self.discovery is not None:
            await run_in_threadpool(self.discovery.stop)
        for task in (self._health_task, self._watch_task, *self._resync_tasks):
            if task is None:
                continue
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.client is not None:
            await self.client.aclose()
        if self.intake is not None:
            await run_in_threadpool(self.intake.close)
        self.index.close()

    # --- rebuilding the index ----------------------------------------------------------------

    async def _watch_index(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                lost = await run_in_threadpool(self.index.lost_state)
            except IndexUnavailableError:
                continue  # down: asked again once it is back
            if lost:
                logger.warning("the index lost its state: asking every backend to re-publish")
                for pod in self.pool.ids:
                    self.request_resync(pod)

    # --- discovered backends -----------------------------------------------------------------

    def _discovered(self, backends: dict[str, BackendSpec]) -> None:
        # The discovery thread: the pool belongs to the event loop.
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the router is shutting down
                self._loop.call_soon_threadsafe(self.sync_discovered, backends)

    def sync_discovered(self, backends: dict[str, BackendSpec]) -> None:
        """Make the pool's discovered backends `backends` (on the event loop); a backend that goes
        stops publishing into the index and its entries are cleared (events.py, in order with its
        batches), a new one is subscribed to as a static backend with events is."""
        added, removed = self.pool.sync(backends)
        if self.intake is not None:
            for pod in removed:
                self.intake.remove_pod(pod)
            for spec in added:
                self.intake.add_pod(spec.pod_id, spec.events, spec.replay)

    def _on_pod_cleared(self, pod: str, reason: str) -> None:
        # Event worker thread. A pod whose history was lost holds KV the index no longer knows.
        if reason.startswith("history lost") and self._loop is not None:
            self._loop.call_soon_threadsafe(self.request_resync, pod)

    def request_resync(self, pod: str) -> None:
        """Ask a backend to re-publish its whole cache state (once at a time per backend)."""
        backend = self.pool.backends.get(pod)
        if backend is None or pod in self._resyncing or self.client is None:
            return
        self._resyncing.add(pod)
        task = asyncio.create_task(self._resync(backend))
        self._resync_tasks.add(task)
        task.add_done_callback(self._resync_tasks.discard)

    async def _resync(self, backend: Backend) -> None:
        assert self.client is not None
        key = self.config.backend_api_key or self.config.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            resp = await self.client.post(
                f"{backend.url}/kv_events/republish", headers=headers, timeout=self.config.health_timeout_s
            )
            if resp.status_code != 200:
                logger.warning(
                    "backend %s did not re-publish its state: HTTP %d", backend.pod_id, resp.status_code
                )
            else:
                self.resyncs += 1
        except httpx.HTTPError as e:
            logger.warning("backend %s did not re-publish its state: %s", backend.pod_id, e)
        finally:
            self._resyncing.discard(backend.pod_id)

    # --- scoring -----------------------------------------------------------------------------

    def prompt_of(self, body: dict[str, Any], chat: bool) -> tuple[str | list[int] | PromptParts, bool]:
        """(prompt, rendered_chat) of a completions or chat body; ValueError when there is none.
        A chat's `documents` are cut into chunks as the engines cut them, so they score as chunks."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ValueError("'messages' must be a non-empty list")
            kwargs = body.get("chat_template_kwargs") or {}
            return self.processor.render_chat(messages, body.get("documents"), **kwargs), True
        prompt = body.get("prompt")
        # A batch of prompts is scored by its first one: they all go to one backend.
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt, False
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt, False
        raise ValueError("'prompt' must be a string, a list of token ids, or a list of those")

    def score_prompt(
        self,
        prompt: str | Sequence[int] | PromptParts,
        rendered_chat: bool = False,
        lora: str | None = None,
        cache_salt: str | None = None,
        chunked_block_keys: bool = True,
    ) -> ScoreResult:
        """Tokenize and score a prompt against every backend (blocking: run it off the event loop).
        `chunked_block_keys=False`: a chunked prompt's prefix blocks are not looked up (its prefix
        score stays 0), for a policy that scores chunked prompts by their chunks alone."""
        t0 = time.perf_counter()
        tokenized = self.processor.tokenize(prompt, rendered_chat)
        t1 = time.perf_counter()
        keys = self.processor.keys(tokenized, lora, cache_salt, chunked_block_keys)
        result = ScoreResult(None, keys.num_tokens, len(keys.block_keys), len(tokenized.chunks), t1 - t0)
        if time.monotonic() < self._index_down_until:
            return result
        try:
            result.scores = self.scorer.score(
                keys.block_keys, keys.chunk_keys, self.pool.ids, chunk_tokens=keys.chunk_tokens
            )
        except IndexUnavailableError as e:
            logger.warning(
                "index unavailable, routing without it for %.1fs: %s", self.config.index_retry_s, e
            )
            self._index_down_until = time.monotonic() + self.config.index_retry_s
            self.metrics.index_errors.inc()
            return result
        result.score_s = time.perf_counter() - t1
        self.metrics.tokenization_latency.observe(result.tokenize_s)
        self.metrics.scoring_latency.observe(result.score_s)
        return result

    @staticmethod
    def salt_of(body: dict[str, Any]) -> str | None:
        salt = body.get("cache_salt")
        return salt if isinstance(salt, str) and salt else None

    def lora_of(self, body: dict[str, Any]) -> str | None:
        model = body.get("model")
        return model if isinstance(model, str) and model in self.config.lora_names else None

    # --- routing and proxying ----------------------------------------------------------------

    async def decide(
        self, body: dict[str, Any], chat: bool, exclude: set[str]
    ) -> tuple[Decision, ScoreResult | None]:
        if not len(self.pool):
            assert self.discovery is not None  # a pool without discovery has a static backend
            raise NoBackendError(
                f"no backend yet: no pod matching {self.discovery.config.describe(self.discovery.namespace)}"
                " is Running and Ready",
                503,
            )
        cands = [b for b in self.pool.candidates() if b.pod_id not in exclude]
        if not cands:
            raise NoBackendError("every backend refused the connection")
        if not self.picker.needs_scores:
            return self.picker.pick(cands), None
        try:
            prompt, rendered = self.prompt_of(body, chat)
            result = await run_in_threadpool(
                self.score_prompt,
                prompt,
                rendered,
                self.lora_of(body),
                self.salt_of(body),
                # cache_aware scores a chunked prompt by its chunks alone (PodScore.total).
                self.picker.policy != "cache_aware",
            )
        except Exception as e:  # a prompt we cannot read still gets served, by the backend's rules
            logger.debug("prompt not scored: %s", e)
            return Decision(self.picker.least_loaded(cands), "least_loaded", "prompt_unparsed"), None
        decision = self.picker.pick(
            cands, result.scores, result.num_tokens, index_error=result.scores is None
        )
        return decision, result

    def _record(self, decision: Decision, result: ScoreResult | None) -> None:
        self.metrics.decisions.labels(decision.policy, decision.backend.pod_id).inc()
        if decision.fallback is not None:
            self.metrics.fallbacks.labels(decision.fallback).inc()
        if result is not None and result.scores is not None:
            s = result.scores.get(decision.backend.pod_id)
            hit = 0.0 if s is None else s.total(self.picker.policy == "cache_aware")
            self.metrics.record_lookup(result.num_tokens, min(hit, result.num_tokens))

    async def forward(
        self,
        path: str,
        body: dict[str, Any],
        raw: bytes,
        headers: dict[str, str],
        chat: bool,
        stream: bool = False,
    ) -> Upstream:
        """Send the request to the chosen backend; to another one while nothing has reached the
        client: when the backend refuses the connection, drops it before answering, answers 503,
        or (`stream`) breaks before the first bytes of its body. The response is open (its first
        bytes read when streaming, its whole body otherwise); the caller must `release()` it."""
        assert self.client is not None, "Router.start() was not called"
        tried: set[str] = set()
        while True:
            try:
                decision, result = await self.decide(body, chat, tried)
            except NoBackendError:
                self.metrics.requests_failed.inc()
                raise
            backend = decision.backend
            backend.in_flight += 1
            up: Upstream | None = None
            try:
                req = self.client.build_request(
                    "POST",
                    backend.url + path,
                    content=raw,
                    headers=headers,
                    timeout=self.config.request_timeout_s,
                )
                up = Upstream(await self.client.send(req, stream=True), backend)
                if up.resp.status_code == 503 and self._others_left(tried, backend):
                    # Down or overloaded (engine dead, queue full): the request did not run there.
                    self.metrics.proxy_errors.labels(backend.pod_id).inc()
                    tried.add(backend.pod_id)
                    await up.release()
                    continue
                await up.prefetch(whole=not stream)
            except (httpx.TransportError, httpx.StreamError) as e:
                if up is not None:
                    await up.release()
                else:
                    backend.in_flight -= 1
                if isinstance(e, httpx.TimeoutException) and not isinstance(e, httpx.ConnectTimeout):
                    raise  # it did run there, for as long as we allow: do not double the wait
                # Nothing reached the client, so another backend can take the request.
                tried.add(backend.pod_id)
                self.pool.mark(backend, False, f"request failed: {type(e).__name__}")
                self.metrics.proxy_errors.labels(backend.pod_id).inc()
                continue
            except BaseException:
                if up is not None:
                    await up.release()
                else:
                    backend.in_flight -= 1
                raise
            self._record(decision, result)
            return up

    def _others_left(self, tried: set[str], backend: Backend) -> bool:
        return any(b.pod_id not in tried and b is not backend for b in self.pool.candidates())
