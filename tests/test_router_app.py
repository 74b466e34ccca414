"""The router app end to end on loopback: fake OpenAI backends under uvicorn, real KV events over
ZMQ, a real tokenizer directory, and a real redis-server for the outage test."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.testclient import TestClient

from chunkcache.errors import UsageError
from chunkcache.hashing import block_hashes, to_wire
from chunkcache.kv_events import BlockStored, ChunkStored
from chunkcache.kv_publisher import KVEventPublisher
from chunkcache.router.app import add_route_arguments, config_from_args, create_app
from chunkcache.router.backends import (
    Backend,
    BackendSpec,
    load_backends_file,
    parse_backend_list,
    parse_backend_spec,
)
from chunkcache.router.config import RouterConfig
from chunkcache.router.index import MemoryIndex
from chunkcache.router.policy import Picker
from chunkcache.router.scorer import PodScore
from chunkcache.router.service import Router
from chunkcache.router.tokens import PromptProcessor
from tests.support.redis_server import RedisServer, free_port
from tests.support.server_util import ServerThread

pytestmark = pytest.mark.server
MODEL = "tiny-model"


# --- fixtures: a tokenizer directory, fake backends ---------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "user": 3, "assistant": 4, "system": 5, ":": 6}
    vocab.update({f"w{i}": 10 + i for i in range(3000)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant :{% endif %}"
    )
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(path)
    return str(path)


def fake_backend(name: str) -> FastAPI:
    """An OpenAI-shaped server that says who it is; `/health` follows `app.state.healthy`."""
    app = FastAPI()
    app.state.healthy = True
    app.state.requests = 0

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if app.state.healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": name}]}

    async def answer(request: Request) -> Response:
        body = await request.json()
        app.state.requests += 1
        await asyncio.sleep(float(body.get("delay", 0)))
        if body.get("stream"):

            async def events() -> Any:
                for i in range(3):
                    yield f"data: {json.dumps({'backend': name, 'i': i})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"object": "text_completion", "backend": name, "choices": [{"text": name}]})

    app.post("/v1/completions")(answer)
    app.post("/v1/chat/completions")(answer)
    return app


@pytest.fixture(scope="module")
def backends() -> Iterator[dict[str, ServerThread]]:
    servers = {name: ServerThread(fake_backend(name)).start() for name in ("a", "b")}
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture(autouse=True)
def healthy_backends(backends: dict[str, ServerThread]) -> None:
    for s in backends.values():
        s.app.state.healthy = True


@pytest.fixture
def publishers() -> Iterator[dict[str, KVEventPublisher]]:
    pubs = {n: KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") for n in ("a", "b")}
    yield pubs
    for p in pubs.values():
        p.close()


def specs(backends: dict[str, ServerThread], pubs: dict[str, KVEventPublisher] | None = None) -> tuple:
    return tuple(
        BackendSpec(s.url, n, pubs[n].endpoint if pubs else None, pubs[n].replay_endpoint if pubs else None)
        for n, s in backends.items()
    )


def make_client(config: RouterConfig, **kw: Any) -> TestClient:
    return TestClient(create_app(Router(config, **kw)))


def words(n: int, start: int = 0) -> str:
    return " ".join(f"w{start + i}" for i in range(n))


def engine_events(token_ids: list[int], seed: str = "0") -> list[BlockStored]:
    hashes = [to_wire(h) for h in block_hashes(seed, token_ids, 16)]
    return [BlockStored(hashes, None, token_ids[: 16 * len(hashes)], 16)]


def wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def publish_until_scored(
    client: TestClient, pub: KVEventPublisher, events: list, body: dict, pod: str
) -> dict:
    """Publish until the router's index shows the events (the SUB socket joins asynchronously)."""
    deadline = time.monotonic() + 5
    while True:
        pub.publish(events)
        scores = client.post("/score", json=body).json()["scores"]
        if scores.get(pod, {}).get("score", 0) > 0:
            return scores
        assert time.monotonic() < deadline, "events never reached the index"
        time.sleep(0.05)


def metric(client: TestClient, line_start: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --- routing ------------------------------------------------------------------------------------


def test_cache_aware_routes_to_the_pod_holding_the_prefix(
    backends: dict[str, ServerThread], publishers: dict[str, KVEventPublisher], tokenizer_dir: str
) -> None:
    config = RouterConfig(specs(backends, publishers), MODEL, tokenizer_dir, health_interval_s=0)
    prompt = words(80, 100)
    with make_client(config) as client:
        ids = client.app.state.router.processor.tokenizer.encode(prompt)
        scores = publish_until_scored(client, publishers["b"], engine_events(ids), {"prompt": prompt}, "b")
        assert scores["b"]["prefix_blocks"] == 5 and scores["a"]["score"] == 0
        for _ in range(3):
            r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4})
            assert r.status_code == 200 and r.json()["backend"] == "b"
            assert r.headers["x-chunkcache-backend"] == "b"
        assert (
            metric(client, 'chunkcache_router_routing_decisions_total{backend="b",policy="cache_aware"}') == 3
        )
        assert metric(client, "chunkcache_router_hit_ratio") > 0.9
        assert metric(client, "chunkcache_router_index_size") == 5
        # A prompt nobody holds: least-loaded, and the metrics say why.
        r = client.post("/v1/completions", json={"prompt": words(40, 2000)})
        assert r.status_code == 200
        assert metric(client, 'chunkcache_router_fallbacks_total{reason="no_index_knowledge"}') == 1


def test_reordered_chunks_land_where_they_are_cached(
    backends: dict[str, ServerThread], publishers: dict[str, KVEventPublisher], tokenizer_dir: str
) -> None:
    index = MemoryIndex()
    config = RouterConfig(specs(backends, publishers), MODEL, tokenizer_dir, health_interval_s=0)
    docs = [words(60, 300), words(50, 400), words(70, 500)]
    sysp, sep = "system : w1 w2", " # # "
    first = sep.join([sysp, docs[0], docs[1], docs[2], "w9 ?"])
    reordered = sep.join([sysp, docs[2], docs[0], docs[1], "w8 w7"])
    with make_client(config, index=index) as client:
        proc: PromptProcessor = client.app.state.router.processor
        keys = proc.keys(proc.tokenize(first))
        stored = [ChunkStored(keys.chunk_keys, keys.chunk_tokens)]
        scores = publish_until_scored(client, publishers["a"], stored, {"prompt": reordered}, "a")
        # The three documents plus the system part, which the engine's pool holds as well.
        sys_len = len(proc.tokenize(first).prefix_token_ids)
        assert scores["a"]["chunk_tokens"] == 180 + sys_len and scores["a"]["prefix_only_score"] == 0
        r = client.post("/v1/completions", json={"prompt": reordered})
        assert r.json()["backend"] == "a"
        # A prefix-only router over the same index sees nothing of the chunks.
        prefix_only = RouterConfig(
            specs(backends), MODEL, tokenizer_dir, policy="prefix_only", health_interval_s=0
        )
        with make_client(prefix_only, index=index) as blind:
            assert blind.post("/v1/completions", json={"prompt": reordered}).status_code == 200
            assert metric(blind, 'chunkcache_router_fallbacks_total{reason="no_index_knowledge"}') == 1


def test_chat_is_rendered_and_streams_pass_through(
    backends: dict[str, ServerThread], publishers: dict[str, KVEventPublisher], tokenizer_dir: str
) -> None:
    config = RouterConfig(specs(backends, publishers), MODEL, tokenizer_dir, health_interval_s=0)
    messages = [{"role": "system", "content": words(40, 700)}, {"role": "user", "content": words(30, 800)}]
    with make_client(config) as client:
        proc: PromptProcessor = client.app.state.router.processor
        ids = list(proc.tokenize(proc.render_chat(messages), rendered_chat=True).prefix_token_ids)
        assert ids.count(1) == 1  # the template's BOS only, not a second one
        publish_until_scored(client, publishers["a"], engine_events(ids), {"messages": messages}, "a")
        body = {"model": MODEL, "messages": messages, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            text = "".join(r.iter_text())
        assert text.count("data: ") == 4 and text.endswith("data: [DONE]\n\n") and '"backend": "a"' in text
        router: Router = client.app.state.router
        assert all(b.in_flight == 0 for b in router.pool)


def test_redis_outage_falls_back_to_least_loaded(
    backends: dict[str, ServerThread],
    publishers: dict[str, KVEventPublisher],
    tokenizer_dir: str,
    redis_server: RedisServer,
) -> None:
    config = RouterConfig(
        specs(backends, publishers), MODEL, tokenizer_dir, index=redis_server.url, health_interval_s=0
    )
    prompt = words(64, 1200)
    with make_client(config) as client:
        ids = client.app.state.router.processor.tokenizer.encode(prompt)
        publish_until_scored(client, publishers["a"], engine_events(ids), {"prompt": prompt}, "a")
        assert client.post("/v1/completions", json={"prompt": prompt}).json()["backend"] == "a"
        redis_server.stop()
        served = [client.post("/v1/completions", json={"prompt": prompt}) for _ in range(6)]
        assert [r.status_code for r in served] == [200] * 6
        assert {r.json()["backend"] for r in served} == {"a", "b"}  # least-loaded spreads them
        assert metric(client, 'chunkcache_router_fallbacks_total{reason="index_unavailable"}') == 6
        assert metric(client, "chunkcache_router_index_errors_total") >= 1
        assert (
            metric(client, 'chunkcache_router_routing_decisions_total{backend="b",policy="least_loaded"}')
            >= 1
        )
        assert client.post("/score", json={"prompt": prompt}).status_code == 503
        assert client.get("/metrics").status_code == 200  # index size unknown, scrape still works


def test_refused_connections_are_retried_elsewhere(
    backends: dict[str, ServerThread], tokenizer_dir: str
) -> None:
    dead = BackendSpec(f"http://127.0.0.1:{free_port()}", "dead")
    config = RouterConfig(
        (*specs(backends), dead), MODEL, tokenizer_dir, policy="round_robin", health_interval_s=0
    )
    with make_client(config) as client:
        served = [client.post("/v1/completions", json={"prompt": "w1"}) for _ in range(6)]
        assert all(r.status_code == 200 for r in served)
        assert metric(client, 'chunkcache_router_proxy_errors_total{backend="dead"}') == 1
        assert client.get("/health").json()["backends"] == {"a": True, "b": True, "dead": False}


def test_health_checks_eject_and_readmit(backends: dict[str, ServerThread], tokenizer_dir: str) -> None:
    config = RouterConfig(specs(backends), MODEL, tokenizer_dir, policy="round_robin", health_interval_s=0.1)
    with make_client(config) as client:
        backends["b"].app.state.healthy = False
        wait_for(lambda: not client.get("/health").json()["backends"]["b"])
        assert {
            client.post("/v1/completions", json={"prompt": "w1"}).json()["backend"] for _ in range(4)
        } == {"a"}
        assert metric(client, 'chunkcache_router_backend_healthy{backend="b"}') == 0
        backends["b"].app.state.healthy = True
        wait_for(lambda: client.get("/health").json()["backends"]["b"])
        assert {
            client.post("/v1/completions", json={"prompt": "w1"}).json()["backend"] for _ in range(4)
        } == {"a", "b"}


def test_endpoints_and_bad_requests(backends: dict[str, ServerThread], tokenizer_dir: str) -> None:
    config = RouterConfig(specs(backends), MODEL, tokenizer_dir, health_interval_s=0)
    with make_client(config) as client:
        assert client.post("/v1/completions", content=b"{not json").status_code == 400
        assert client.post("/score", json={"prompt": 5}).status_code == 400
        scores = client.post("/score", json={"prompt": [1, 2, 3]}).json()
        assert scores["num_tokens"] == 3 and set(scores["scores"]) == {"a", "b"}
        assert client.get("/v1/models").json()["data"][0]["id"] == MODEL
        assert client.get("/health").json()["status"] == "ok"
        # A body the router cannot read still reaches a backend, which owns the error.
        assert client.post("/v1/completions", json={"max_tokens": 1}).status_code == 200
        assert metric(client, 'chunkcache_router_fallbacks_total{reason="prompt_unparsed"}') == 1
        text = client.get("/metrics").text
        for name in (
            "scoring_latency_seconds_bucket",
            "backend_in_flight",
            "events_processed",
            "lookups_total",
        ):
            assert f"chunkcache_router_{name}" in text or name == "events_processed"


# --- policies, specs, command line --------------------------------------------------------------


def test_policies_pick_as_documented() -> None:
    a, b = Backend(BackendSpec("http://a", "a")), Backend(BackendSpec("http://b", "b"))
    a.in_flight = 1
    assert Picker("least_loaded").pick([a, b]).backend is b
    rr = Picker("round_robin")
    assert [rr.pick([a, b]).backend.pod_id for _ in range(4)] == ["a", "b", "a", "b"]
    assert Picker("random", seed=1).pick([a, b]).policy == "random"
    scores = {"a": PodScore(4, 64.0, 0), "b": PodScore(0, 0.0, 32)}
    assert Picker("cache_aware").pick([a, b], scores, 100).backend is a  # 0.64 - 0.5 * 1/2 > 0.32
    assert Picker("cache_aware", load_weight=2.0).pick([a, b], scores, 100).backend is b  # load wins
    assert Picker("prefix_only").pick([a, b], {"b": PodScore(0, 0, 90)}, 100).fallback == "no_index_knowledge"
    d = Picker("cache_aware").pick([a, b], None, 100, index_error=True)
    assert (d.backend, d.policy, d.fallback) == (b, "least_loaded", "index_unavailable")
    with pytest.raises(ValueError):
        Picker("fastest")


def test_a_prompt_no_backend_holds_enough_of_goes_to_the_least_loaded() -> None:
    a, b, c = (Backend(BackendSpec(f"http://{n}", n)) for n in "abc")
    a.in_flight, b.in_flight, c.in_flight = 2, 1, 0
    # `a` holds 40% of the prompt, the others a little: below a threshold of 0.5 the prompt is
    # mostly new everywhere, and the idle backend takes it (and caches its documents).
    scores = {"a": PodScore(chunk_tokens=40, chunked=True), "b": PodScore(chunk_tokens=5, chunked=True)}
    d = Picker("cache_aware", cache_threshold=0.5).pick([a, b, c], scores, 100)
    assert (d.backend, d.policy, d.fallback) == (c, "least_loaded", "below_cache_threshold")
    # The default (0): the cached share net of load (0.4 - 0.5 * 2/3 > 0.05 - 0.5 * 1/3 > 0).
    d = Picker("cache_aware").pick([a, b, c], scores, 100)
    assert (d.backend, d.policy, d.fallback) == (a, "cache_aware", None)
    # At or above the threshold the cache decides, load weighed as before.
    scores["a"] = PodScore(chunk_tokens=50, chunked=True)
    assert Picker("cache_aware", cache_threshold=0.5).pick([a, b, c], scores, 100).backend is a
    # prefix_only measures its prefix share against the same threshold.
    prefix = {"a": PodScore(prefix_blocks=3, prefix_tokens=48.0)}
    d = Picker("prefix_only", cache_threshold=0.5).pick([a, b, c], prefix, 100)
    assert d.fallback == "below_cache_threshold"
    assert Picker("prefix_only", cache_threshold=0.4).pick([a, b, c], prefix, 100).backend is a
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="cache_threshold"):
            Picker("cache_aware", cache_threshold=bad)


def test_backend_specs_and_files(tmp_path: Path) -> None:
    s = parse_backend_spec("r1@http://10.0.0.5:8000/=tcp://10.0.0.5:5557=tcp://10.0.0.5:5558")
    assert s == BackendSpec("http://10.0.0.5:8000", "r1", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558")
    assert parse_backend_spec("http://h:1").pod_id == "http://h:1"
    assert [b.url for b in parse_backend_list(["http://h:1,http://h:2", "http://h:3"])] == [
        "http://h:1",
        "http://h:2",
        "http://h:3",
    ]
    for bad in ("ftp://x", "http://h=a=b=c", ""):
        with pytest.raises(ValueError):
            parse_backend_spec(bad)
    lines = tmp_path / "backends.txt"
    lines.write_text("# cluster\nhttp://h:1=tcp://h:5557\n\nx@http://h:2  # second\n")
    assert [(b.pod_id, b.events) for b in load_backends_file(lines)] == [
        ("http://h:1", "tcp://h:5557"),
        ("x", None),
    ]
    js = tmp_path / "backends.json"
    js.write_text(
        json.dumps({"backends": [{"url": "http://h:1", "name": "n", "events": "tcp://h:1"}, "http://h:9"]})
    )
    assert [b.pod_id for b in load_backends_file(js)] == ["n", "http://h:9"]


def test_command_line(tokenizer_dir: str) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_route_arguments(parser)
    argv = ["--backends", "http://h:1=tcp://h:5557,http://h:2", "--backend", "z@http://h:3"]
    argv += ["--tokenizer", tokenizer_dir, "--model-name", MODEL, "--policy", "prefix_only"]
    argv += ["--tier-weights", "GPU=1,CPU=0.5,DISK=0.1", "--index", "redis://127.0.0.1:1/0"]
    args = parser.parse_args(argv)
    config = config_from_args(args)
    assert [s.pod_id for s in config.backends] == ["http://h:1", "http://h:2", "z"]
    assert config.backends[0].events == "tcp://h:5557" and config.policy == "prefix_only"
    assert config.tier_weights == {"GPU": 1.0, "CPU": 0.5, "DISK": 0.1, "REMOTE": 0.3}  # unnamed: default
    assert config.remote_pods is None  # every backend shares the remote tier
    args = parser.parse_args([*argv, "--remote-tier-backends", "z,http://h:2"])
    assert config_from_args(args).remote_pods == ("z", "http://h:2")
    with pytest.raises(UsageError, match="unknown backends"):
        config_from_args(parser.parse_args([*argv, "--remote-tier-backends", "nope"]))
    out = subprocess.run(
        [sys.executable, "-m", "chunkcache.router", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--backends-file" in out.stdout


def test_errors_carry_openai_code_strings_and_docs_are_off(
    backends: dict[str, ServerThread], tokenizer_dir: str
) -> None:
    """Issue 35: error bodies carried `code` as the HTTP status (an integer), and /docs and
    /openapi.json described the deployment to anyone."""
    config = RouterConfig(specs(backends), MODEL, tokenizer_dir, api_key="k", health_interval_s=0)
    with make_client(config) as client:
        err = client.post("/v1/completions", json={"prompt": "w1"}).json()["error"]
        assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
        auth = {"Authorization": "Bearer k"}
        err = client.post("/v1/completions", content=b"{nope", headers=auth).json()["error"]
        assert err["code"] is None and err["type"] == "invalid_request_error"
        # A lone surrogate is refused before the router tokenizes it, naming the field.
        r = client.post("/v1/completions", content=b'{"prompt": "a \\ud800"}', headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        for path in ("/docs", "/openapi.json", "/redoc"):
            r = client.get(path, headers=auth)
            assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    dead = RouterConfig((BackendSpec(f"http://127.0.0.1:{free_port()}", "dead"),), MODEL, tokenizer_dir)
    with make_client(dead) as client:
        err = client.post("/v1/completions", json={"prompt": "w1"}).json()["error"]
        assert isinstance(err["code"], str), err
    with make_client(RouterConfig(specs(backends), MODEL, tokenizer_dir, serve_docs=True)) as client:
        assert client.get("/openapi.json").status_code == 200


def test_router_event_socket_binds_loopback_without_curve(tokenizer_dir: str) -> None:
    config = RouterConfig(
        (BackendSpec("http://127.0.0.1:9", "a"),), MODEL, tokenizer_dir, events_bind="tcp://*:0"
    )
    router = Router(config)
    try:
        assert router.intake is not None and router.intake.bound_endpoint.startswith("tcp://127.0.0.1:")
    finally:
        router.intake.close()
    import argparse

    parser = argparse.ArgumentParser()
    add_route_arguments(parser)
    argv = ["--backends", "http://h:1", "--tokenizer", tokenizer_dir, "--model-name", MODEL]
    config = config_from_args(parser.parse_args([*argv, "--events-insecure", "--serve-docs"]))
    assert config.events_insecure is True and config.serve_docs is True
    assert config_from_args(parser.parse_args(argv)).events_insecure is False
