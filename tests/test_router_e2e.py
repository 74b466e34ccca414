"""End to end on loopback: two `chunkcache serve` replicas behind the cache-aware router, KV events
over real ZMQ sockets.

Each replica is the real server app (`build_app`) configured from `chunkcache serve`'s own flags, on
its own engine and its own uvicorn thread (in-process: two more interpreters importing torch would
take most of the time budget on a loaded machine). Each engine publishes on its own loopback
endpoint (`tcp://127.0.0.1:0` binds an ephemeral port) with a replay endpoint; the router connects
a SUB socket to each, as `chunkcache route --backends NAME@URL=EVENTS=REPLAY` does. The
router-binds, replicas-connect deployment runs in `benchmarks/bench_router_cluster.py`.

A RAG request `SYS # # D1 # # D2 # # D3 # # Q` goes through the router; then the same documents in
another order with another question. Both replicas hold the system part (the second one served
another RAG request directly), so the prefix-only score ties while the chunk score points at the
replica holding the documents, and the router sends the request there.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from chunkcache.config import EngineConfig
from chunkcache.engine.engine import LLMEngine
from chunkcache.engine_args import engine_options
from chunkcache.router.app import create_app
from chunkcache.router.backends import BackendSpec
from chunkcache.router.config import RouterConfig
from chunkcache.router.service import Router
from chunkcache.server.app import build_app
from chunkcache.server.cli import add_serve_arguments
from tests.support.prompts import SEP
from tests.support.server_util import ServerThread

pytestmark = pytest.mark.server
MODEL = "tiny-e2e"
SYSTEM = (
    "You are a careful assistant. Read the documents below and answer the question with the facts "
    "they give, citing the document you used."
)


def wait_for(cond: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    """Poll `cond` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def serve_replica(model: Path, name: str) -> ServerThread:
    """What `chunkcache serve --model M --served-model-name ... --kv-events-endpoint ...` runs."""
    argv = [
        "--model", str(model), "--served-model-name", MODEL, "--device", "cpu", "--dtype", "float32",
        "--kv-cache-tokens", "4096", "--chunk-cache-size-gb", "0.01", "--chunk-layout", "isolated",
        "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0",
        "--kv-events-topic", f"kv@{name}@{MODEL}",
    ]  # fmt: skip
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(argv)
    config = EngineConfig.from_options(args.model, use_env=False, **engine_options(args))
    engine = LLMEngine(config)
    app = build_app(
        engine, api_key=None, max_queue=args.max_queue, served_model_name=config.served_model_name
    )
    return ServerThread(app)


def replica_spec(name: str, server: ServerThread) -> BackendSpec:
    publisher = server.engine_loop.engine.publisher
    assert publisher is not None and publisher.replay_endpoint is not None
    # The ports the engine bound, on loopback: the router connects to them.
    assert publisher.endpoint.startswith("tcp://127.0.0.1:") and not publisher.endpoint.endswith(":0")
    return BackendSpec(server.url, name, publisher.endpoint, publisher.replay_endpoint)


@pytest.fixture(scope="module")
def cluster(
    checkpoint: Callable[..., Path],
) -> Iterator[tuple[ServerThread, Router, dict[str, ServerThread]]]:
    model = checkpoint()
    replicas: dict[str, ServerThread] = {}
    started: list[ServerThread] = []
    try:
        for name in ("r0", "r1"):
            replicas[name] = serve_replica(model, name)
            started.append(replicas[name].start())
        config = RouterConfig(
            backends=tuple(replica_spec(n, s) for n, s in replicas.items()),
            model_name=MODEL,  # part of every chunk key: must be the replicas' served name
            tokenizer=str(model),
            event_workers=2,
            health_interval_s=1.0,
            request_timeout_s=60.0,
        )
        router = Router(config)
        started.append(ServerThread(create_app(router)).start())
        yield started[-1], router, replicas
    finally:
        for server in reversed(started):  # the router first, then the replicas (engines closed)
            server.stop()


# --- helpers --------------------------------------------------------------------------------------


def documents(tok: Any, n: int) -> list[str]:
    """`n` distinct documents of about 60 tokens (sentences of the tiny tokenizer's corpus)."""
    from tests.support.tiny_checkpoint import corpus

    lines = [line.strip() for line in corpus(num_lines=400, seed=7) if "#" not in line]
    docs: list[str] = []
    k = 0
    for i in range(n):
        parts = [f"Document {i}."]
        while len(tok.encode(" ".join(parts), add_special_tokens=False)) < 60:
            parts.append(lines[k % len(lines)])
            k += 1
        docs.append(" ".join(parts))
    return docs


def rag(docs: list[str], question: str) -> str:
    return SEP.join([SYSTEM, *docs, question])


def complete(base: str, prompt: str, stream: bool = False) -> tuple[str | None, dict[str, Any]]:
    """(backend header, usage) of one greedy completion."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    with httpx.Client(timeout=60) as client, client.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        backend = r.headers.get("x-chunkcache-backend")
        if not stream:
            return backend, json.loads(r.read())["usage"]
        usage: dict[str, Any] = {}
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
        return backend, usage


def chunk_stats(server: ServerThread) -> dict[str, Any]:
    return httpx.get(f"{server.url}/v1/chunk_cache/stats", timeout=10).json()


def score(base: str, prompt: str) -> dict[str, Any]:
    r = httpx.post(f"{base}/score", json={"prompt": prompt}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def decisions(base: str) -> dict[str, float]:
    """The router's cache_aware routing decisions per backend, from /metrics."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("chunkcache_router_routing_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            if 'policy="cache_aware"' in labels:
                backend = labels.split('backend="', 1)[1].split('"', 1)[0]
                out[backend] = out.get(backend, 0.0) + float(value)
    return out


# --- the test -------------------------------------------------------------------------------------


def test_reordered_rag_request_lands_on_the_replica_holding_its_chunks(
    cluster: tuple[ServerThread, Router, dict[str, ServerThread]],
) -> None:
    router_server, router, replicas = cluster
    base = router_server.url
    docs = documents(router.processor.tokenizer, 5)
    d1, d2, d3, x1, x2 = docs
    first = rag([d1, d2, d3], "Who wrote the first document?")
    again = rag([d3, d1, d2], "Which document mentions a river?")

    # 1. The first request: the index knows nothing yet, so any replica may take it.
    holder, usage = complete(base, first)
    assert holder in replicas, holder
    other = next(n for n in replicas if n != holder)
    assert usage["prompt_tokens"] == score(base, first)["num_tokens"]

    # 2. The other replica serves another RAG request with the same system prompt directly (not
    #    through the router): it then holds chunks too, and the same system part.
    warm = rag([x1, x2], "What is the second document about?")
    complete(replicas[other].url, warm)

    # 3. Wait (polling /score) until both replicas' events are in the index: all three chunks of
    #    the reordered request on the holder, both chunks of the direct request on the other one.
    parsed = router.processor.tokenize(again)
    # The system part is a chunk-pool entry of its own on both replicas, scored like a chunk.
    sys_tokens = len(parsed.prefix_token_ids)
    chunk_tokens = sum(len(c) for c in parsed.chunks) + sys_tokens
    warm_tokens = sum(len(c) for c in router.processor.tokenize(warm).chunks) + sys_tokens
    assert len(parsed.chunks) == 3 and len(parsed.prefix_token_ids) >= 16

    def settled() -> dict[str, Any] | None:
        s = score(base, again)
        ready = s["scores"][holder]["chunk_tokens"] == chunk_tokens
        return s if ready and score(base, warm)["scores"][other]["chunk_tokens"] == warm_tokens else None

    s = wait_for(settled, 20, "the replicas' KV events to reach the router's index")
    h, o = s["scores"][holder], s["scores"][other]
    assert s["num_chunks"] == 3
    # The chunk score finds the documents on the holder, in their new order...
    assert o["chunk_tokens"] == sys_tokens
    assert h["score"] >= chunk_tokens > o["score"]
    # ...while the prefix-only score cannot tell the replicas apart: layout "isolated" computes
    # only Q in the request's own blocks, so nothing enters a prefix cache and both scores are 0.
    assert h["prefix_only_score"] == o["prefix_only_score"]
    assert h["prefix_blocks"] == o["prefix_blocks"]

    # 4. The reordered request, with another question, goes to the holder and hits its chunks.
    before_decisions = decisions(base)
    before = {n: chunk_stats(r) for n, r in replicas.items()}
    backend, usage = complete(base, again, stream=True)
    assert backend == holder
    after_decisions = decisions(base)
    assert after_decisions.get(holder, 0) == before_decisions.get(holder, 0) + 1
    assert after_decisions.get(other, 0) == before_decisions.get(other, 0)
    after = {n: chunk_stats(r) for n, r in replicas.items()}
    assert after[holder]["hits"] - before[holder]["hits"] == 3
    assert after[holder]["misses"] == before[holder]["misses"]
    assert after[other]["hits"] == before[other]["hits"]
    # The engine reports the reused chunk tokens and the system part as cached.
    assert usage["prompt_tokens_details"]["cached_tokens"] >= chunk_tokens

    # 5. Layout "offset" computes S and the first document at their natural positions: a plain
    #    prefill's KV, which the replica registers in its prefix cache and reports as BlockStored.
    #    A prefix-only router then sees past S on that replica, as it would with any prefix.
    offset = rag([x2, d2], "Where is the bridge?")
    body = {"model": MODEL, "prompt": offset, "max_tokens": 2, "temperature": 0, "chunk_layout": "offset"}
    assert httpx.post(f"{replicas[other].url}/v1/completions", json=body, timeout=60).status_code == 200
    follow = rag([x2, d1], "Who keeps the mill?")
    exact_blocks = (sys_tokens + len(router.processor.tokenize(follow).chunks[0])) // 16

    def seen() -> dict[str, Any] | None:
        s = score(base, follow)["scores"]
        return s if s[other]["prefix_blocks"] == exact_blocks else None

    s = wait_for(seen, 20, "the offset request's BlockStored events to reach the router's index")
    assert s[holder]["prefix_blocks"] == 0 and s[other]["prefix_only_score"] > 0
    # The chunk score is what the engine reuses for a chunked prompt: the prefix adds nothing to it.
    assert s[other]["score"] == s[other]["chunk_tokens"]


def test_chat_documents_are_scored_as_chunks_and_routed_to_their_holder(
    cluster: tuple[ServerThread, Router, dict[str, ServerThread]],
) -> None:
    """`documents` on chat completions, through the router with the official client: the router
    cuts the chat into the same chunks as the engines, so a reordered request scores them."""
    import openai

    router_server, router, replicas = cluster
    base = router_server.url
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    d1, d2, d3 = documents(router.processor.tokenizer, 8)[5:]
    d2_titled = {"title": "Second", "text": d2}

    def chat(docs: list[Any], question: str) -> tuple[str | None, Any]:
        raw = client.chat.completions.with_raw_response.create(
            model=MODEL,
            messages=[{"role": "user", "content": question}],
            max_tokens=4,
            temperature=0,
            extra_body={"documents": docs},
        )
        return raw.headers.get("x-chunkcache-backend"), raw.parse()

    holder, _ = chat([d1, d2_titled, d3], "Who wrote the first document?")
    assert holder in replicas
    other = next(n for n in replicas if n != holder)
    again_docs = [d3, d1, d2_titled]
    body = {"messages": [{"role": "user", "content": "What is in the third?"}], "documents": again_docs}
    parts = router.processor.render_chat(body["messages"], again_docs)
    parsed = router.processor.tokenize(parts, rendered_chat=True)
    assert len(parsed.chunks) == 3
    doc_tokens = sum(len(c) for c in parsed.chunks) + len(parsed.prefix_token_ids)

    def settled() -> dict[str, Any] | None:
        r = httpx.post(f"{base}/score", json=body, timeout=10)
        assert r.status_code == 200, r.text
        s = r.json()
        return s if s["scores"][holder]["chunk_tokens"] == doc_tokens else None

    s = wait_for(settled, 20, "the holder's chunk events to reach the router's index")
    assert s["num_chunks"] == 3
    assert s["scores"][holder]["score"] > s["scores"][other]["score"]
    backend, answer = chat(again_docs, "What is in the third?")
    assert backend == holder
    assert answer.usage.prompt_tokens == parsed.num_tokens
    assert answer.usage.prompt_tokens_details.cached_tokens == doc_tokens
