"""Faults a user or a network can cause (issue 16): no request may stop, hang or poison the server.

Each defect is reproduced against a real `chunkcache serve` process where only a process shows it
(exit status, a thread that dies for good, SIGTERM), or an in-process server where the test must
reach inside (a fault injected into one batch); scheduler and validation rules also have unit tests.
Every wait is bounded.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.testclient import TestClient

from chunkcache.config import ChunkConfig, EngineConfig, SchedulerConfig
from chunkcache.core.kv_blocks import BlockManager
from chunkcache.core.sequence import Sequence
from chunkcache.engine.engine import LLMEngine
from chunkcache.engine.scheduler import Scheduler
from chunkcache.errors import InvalidRequestError
from chunkcache.hashing import BlockKeys
from chunkcache.router.app import create_app
from chunkcache.router.backends import BackendSpec
from chunkcache.router.config import RouterConfig
from chunkcache.router.service import Router
from chunkcache.sampling import MAX_STOP_STRINGS, SamplingParams
from chunkcache.server.app import build_app
from chunkcache.server.cli import DEFAULT_DRAIN_TIMEOUT, add_serve_arguments
from tests.support.server_util import ServerProcess, ServerThread

# 1024 KV tokens = 64 blocks of 16: the over-committed configuration.
SERVE_ARGS = [
    "--device",
    "cpu",
    "--kv-cache-tokens",
    "1024",
    "--max-model-len",
    "2048",
    "--log-level",
    "warning",
]
REQUEST_TIMEOUT = 120.0


@pytest.fixture(scope="module")
def model_dir(checkpoint: Callable[..., Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def proc(model_dir: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(["--model", str(model_dir), *SERVE_ARGS, "--max-request-bytes", "200000"])
    try:
        yield server.wait_healthy()
    finally:
        server.stop()


@pytest.fixture
def http(proc: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=proc.url, timeout=REQUEST_TIMEOUT) as c:
        yield c


def error_of(r: httpx.Response) -> dict[str, Any]:
    return r.json()["error"]


def assert_serves(http: httpx.Client) -> None:
    """The server still answers an ordinary request, and says it is healthy."""
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert http.get("/health").status_code == 200


# ---- defect 1: one request kills the engine ----------------------------------------------------


def test_tiny_temperature_is_greedy_not_fatal(http: httpx.Client) -> None:
    base = {"prompt": "Zorvath sells apples", "max_tokens": 8, "ignore_eos": True}
    greedy = http.post("/v1/completions", json={**base, "temperature": 0})
    tiny = http.post("/v1/completions", json={**base, "temperature": 1e-38})
    assert greedy.status_code == tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    assert_serves(http)


@pytest.mark.parametrize(
    ("field", "literal"),
    [
        ("temperature", "NaN"),
        ("temperature", "Infinity"),
        ("top_p", "NaN"),
        ("top_p", "-Infinity"),
        ("blend_threshold", "NaN"),
        ("blend_threshold", "Infinity"),
        ("presence_penalty", "NaN"),
    ],
)
def test_non_finite_floats_are_400_naming_the_field(http: httpx.Client, field: str, literal: str) -> None:
    # Python's JSON parser accepts these literals; the server must not.
    body = f'{{"prompt": "hi", "max_tokens": 2, "{field}": {literal}}}'
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert error_of(r)["param"] == field
    assert "finite" in error_of(r)["message"]
    assert_serves(http)


def test_sampling_params_validation_units() -> None:
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature"):
            SamplingParams(temperature=bad)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=float("nan"))
    assert SamplingParams(temperature=1e-38).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.5).greedy
    with pytest.raises(ValueError, match="blend_threshold"):
        ChunkConfig(blend_threshold=float("nan")).validate()
    with pytest.raises(ValueError, match="blend_threshold"):
        ChunkConfig(blend_threshold=float("inf")).validate()


@pytest.fixture(scope="module")
def inproc(model_dir: Path) -> Iterator[ServerThread]:
    options = {"device": "cpu", "dtype": "float32", "kv_cache_tokens": 2048, "max_model_len": 512}
    options["chunk_cache_size_gb"] = 0.01
    engine = LLMEngine(EngineConfig.from_options(str(model_dir), use_env=False, **options))
    srv = ServerThread(build_app(engine, api_key=None, max_queue=64, served_model_name=None)).start()
    yield srv
    srv.stop()


def test_a_failing_batch_fails_its_requests_only(
    inproc: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward that raises ends its batch's requests with an error (500, or an SSE error event);
    the engine goes on, later requests are served and no KV block is lost."""
    engine = inproc.engine_loop.engine
    runner_run = engine.runner.run
    marker = 997  # a token id that only the doomed requests contain

    def run(batch: Any) -> Any:
        if any(marker in s.token_ids for s in batch.seqs):
            raise RuntimeError("injected fault")
        return runner_run(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    with httpx.Client(base_url=inproc.url, timeout=REQUEST_TIMEOUT) as http:
        r = http.post("/v1/completions", json={"prompt": [5, marker, 7], "max_tokens": 4})
        assert r.status_code == 500, r.text
        assert error_of(r)["code"] == "request_failed" and "injected fault" in error_of(r)["message"]
        body = {"prompt": [5, marker, 7], "max_tokens": 4, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as s:
            events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_failed"
        r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert http.get("/health").status_code == 200
    inproc.wait_idle()
    inproc.on_engine(engine.check_integrity)


def test_failing_fill_job_fails_the_requests_waiting_for_it(
    inproc: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk-cache fill job that fails takes down the requests that wait for its chunk, frees its
    pool pages, and the same chunk is computed afresh by the next request."""
    engine = inproc.engine_loop.engine
    runner_run = engine.runner.run
    poisoned = {"on": True}

    def run(batch: Any) -> Any:
        if poisoned["on"] and any(s.kind.is_fill for s in batch.seqs):
            raise RuntimeError("injected fill fault")
        return runner_run(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    prompt = "sys part # # a document about Ashford # # another about Port Kellam # # where?"
    with httpx.Client(base_url=inproc.url, timeout=REQUEST_TIMEOUT) as http:
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
        assert r.status_code == 500, r.text
        inproc.wait_idle()
        poisoned["on"] = False
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
    inproc.wait_idle()
    inproc.on_engine(engine.check_integrity)


@pytest.mark.server
def test_engine_thread_death_makes_health_503(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(
        EngineConfig.from_options(
            str(model_dir), use_env=False, device="cpu", dtype="float32", kv_cache_tokens=512
        )
    )
    srv = ServerThread(build_app(engine, api_key=None, max_queue=8, served_model_name=None)).start()
    deaths: list[BaseException] = []
    srv.engine_loop.on_death = deaths.append
    try:
        # Outside the per-batch guard (the inbox), as a bug in the engine itself would be.
        monkeypatch.setattr(engine, "_admit", lambda: (_ for _ in ()).throw(SystemError("engine bug")))
        with httpx.Client(base_url=srv.url, timeout=REQUEST_TIMEOUT) as http:
            r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 503, r.text
            assert http.get("/health").status_code == 503
        assert len(deaths) == 1 and isinstance(deaths[0], SystemError)
    finally:
        srv.stop()


# Patches the engine so that the first step raises outside the per-batch guard, then runs `serve`.
_DYING_SERVER = """
import sys
from chunkcache.engine.engine import LLMEngine
def broken(self):
    raise SystemError("injected engine bug")
LLMEngine._admit = broken
from chunkcache.server.cli import main
main(sys.argv[1:])
"""


@pytest.mark.server
def test_engine_death_exits_non_zero(model_dir: Path) -> None:
    server = ServerProcess(["--model", str(model_dir), *SERVE_ARGS], script=_DYING_SERVER)
    try:
        server.wait_healthy()
        try:
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            assert r.status_code == 503, r.text
        except httpx.TransportError:
            pass  # the server may already be going down
        code = server.proc.wait(60)
        assert code != 0, server.output()
        assert "the engine died" in server.output()
    finally:
        server.stop()


# ---- defects 2 and 3: KV livelock ------------------------------------------------------------


def _drive(sched: Scheduler, blocks: BlockManager, max_out: int, max_steps: int) -> int:
    """Run the scheduler as the engine does, with a fake model (every step computes what it was
    given and samples token 7); asserts that no waiting sequence holds blocks. Returns steps taken."""
    for step in range(max_steps):
        batch = sched.schedule()
        for seq in sched.waiting:
            assert not seq.block_table, f"waiting {seq.request_id} holds {len(seq.block_table)} blocks"
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed += n
            blocks.register_full_blocks(seq.block_table, seq.token_ids, seq.block_hashes, seq.num_computed)
            if seq.num_computed == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= max_out:
                    sched.finish(seq)
        if not sched.has_work():
            return step
    raise AssertionError(
        f"no progress after {max_steps} steps: {len(sched.running)} running, {len(sched.waiting)} waiting, "
        f"{blocks.num_blocks - blocks.num_free_blocks} of {blocks.num_blocks} blocks held"
    )


def test_scheduler_overcommitted_kv_makes_progress() -> None:
    """The issue's case: 64 blocks, two 260-token prompts each wanting 600 more tokens."""
    blocks = BlockManager(64, 16, enable_prefix_caching=True, hash_seed="0", medium="GPU")
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048), blocks)
    for i in range(2):
        prompt = [(i * 131 + j) % 900 + 1 for j in range(260)]
        sched.add(Sequence(f"r{i}", list(prompt), list(prompt), SamplingParams(max_tokens=600)))
    _drive(sched, blocks, max_out=600, max_steps=20_000)
    assert sched.num_preemptions > 0  # the case did over-commit
    assert blocks.num_free_blocks == blocks.num_blocks
    blocks.check_integrity()


def _stream_text(http: httpx.Client, body: dict[str, Any]) -> tuple[str, str | None]:
    text, reason = "", None
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
    return text, reason


def test_overcommitted_kv_requests_all_finish(http: httpx.Client) -> None:
    prompt = [(j * 7) % 900 + 1 for j in range(260)]
    body = {"max_tokens": 600, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(_stream_text, http, {**body, "prompt": [i + 1, *prompt[1:]]}) for i in range(2)
        ]
        results = [f.result(timeout=REQUEST_TIMEOUT) for f in futures]
    assert [reason for _, reason in results] == ["length", "length"]
    assert_serves(http)


def test_request_larger_than_the_kv_cache_is_refused(http: httpx.Client) -> None:
    prompt = list(range(1, 301))
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 800})
    assert r.status_code == 400, r.text
    err = error_of(r)
    assert err["param"] == "max_tokens"
    assert "KV cache of 1024 tokens" in err["message"] and "at most 724" in err["message"]
    # At the limit it runs; "hi" was never stalled by the refused one.
    r = http.post(
        "/v1/completions", json={"prompt": prompt, "max_tokens": 724, "ignore_eos": True, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 724
    assert_serves(http)


def test_open_max_tokens_is_capped_at_the_kv_cache(model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig.from_options(
            str(model_dir), use_env=False, device="cpu", dtype="float32", kv_cache_tokens=256
        )
    )
    try:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request("a", list(range(1, 101)), SamplingParams(max_tokens=200))
        assert info.value.param == "max_tokens"
        engine.add_request(
            "b", list(range(1, 101)), SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
        )
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        assert len(outputs[0].outputs[0].token_ids) == 156
    finally:
        engine.close()


# ---- defect 4: body size, tokenization off the event loop, stop strings -----------------------


def test_oversized_body_is_413_before_parsing(http: httpx.Client) -> None:
    big = json.dumps({"prompt": "x " * 150_000, "max_tokens": 1})
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert "200000 bytes" in error_of(r)["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit applies while reading
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536].encode()

    r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    assert_serves(http)


def test_text_that_cannot_fit_is_refused_before_tokenizing(http: httpx.Client) -> None:
    """Issue 35: a 3.9 MB prompt was tokenized in full (4 s, hundreds of MB kept) only to get its
    400. Text longer than max_model_len times the longest token is refused at once."""
    prompt = "hello " * 30_000  # 180 kB: within the 200 kB body limit, far over 2,048 tokens
    for path, body, param in (
        ("/v1/completions", {"prompt": prompt, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}]}, "messages"),
    ):
        r = http.post(path, json=body)
        assert r.status_code == 400, r.text
        assert error_of(r)["param"] == param and "before tokenizing" in error_of(r)["message"]
    # Under the bound, the engine still counts the tokens exactly.
    r = http.post("/v1/completions", json={"prompt": "hello " * 3_000, "max_tokens": 1})
    assert r.status_code == 400 and "tokens long" in error_of(r)["message"], r.text
    assert_serves(http)


def test_prompts_are_tokenized_off_the_event_loop(
    inproc: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = inproc.engine_loop.engine
    threads: list[str] = []
    encode = engine.tokenizer.encode

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return encode(*args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", spy)
    with httpx.Client(base_url=inproc.url, timeout=REQUEST_TIMEOUT) as http:
        assert (
            http.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 1}).status_code == 200
        )
        assert http.post("/tokenize", json={"prompt": "hello there"}).status_code == 200
    assert threads and all(t.startswith("chunkcache-prep") for t in threads), threads


def test_stop_strings_are_bounded(http: httpx.Client) -> None:
    r = http.post(
        "/v1/completions", json={"prompt": "hi", "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]}
    )
    assert r.status_code == 400 and error_of(r)["param"] == "stop", r.text
    r = http.post("/v1/completions", json={"prompt": "hi", "stop": ["x" * 5000]})
    assert r.status_code == 400 and error_of(r)["param"] == "stop", r.text


# ---- defect 9: drain default, 64-bit seeds, `param` -------------------------------------------


def test_seed_beyond_64_bits_is_400(http: httpx.Client) -> None:
    for seed in (2**64, -(2**63) - 1):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "seed": seed})
        assert r.status_code == 400, r.text
        assert error_of(r)["param"] == "seed"
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "seed": 2**64 - 1})
    assert r.status_code == 200, r.text


def test_whole_request_errors_name_their_field(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2047})
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens", r.text
    r = http.post("/v1/completions", json={"prompt": [5, 10**6], "max_tokens": 2})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt", r.text
    r = http.post(
        "/v1/completions", json={"prompt": "a # # b # # c", "max_tokens": 2, "chunk_layout": "nope"}
    )
    assert r.status_code == 400 and error_of(r)["param"] == "chunk_layout", r.text


def test_drain_timeout_has_a_default() -> None:
    import argparse

    args = add_serve_arguments(argparse.ArgumentParser()).parse_args([])
    assert args.drain_timeout == DEFAULT_DRAIN_TIMEOUT > 0


@pytest.mark.server
def test_sigterm_with_a_hung_request_exits_within_the_drain_timeout(model_dir: Path) -> None:
    server = ServerProcess(["--model", str(model_dir), *SERVE_ARGS, "--drain-timeout", "2"])
    try:
        server.wait_healthy()
        started = threading.Event()

        def endless() -> None:  # a client that keeps a long request open
            body = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            try:
                with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
                    for _ in r.iter_lines():
                        started.set()
                        time.sleep(0.2)  # a slow reader: the request outlives the drain timeout
            except httpx.HTTPError:
                pass

        reader = threading.Thread(target=endless, daemon=True)
        reader.start()
        assert started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) in (0, -signal.SIGTERM), server.output()
    finally:
        server.stop()


# Slows every engine step to 50 ms, so that a request is still running when the drain times out.
_SLOW_SERVER = """
import sys, time
from chunkcache.engine.engine import LLMEngine
step = LLMEngine.step
def slow(self):
    time.sleep(0.05)
    return step(self)
LLMEngine.step = slow
from chunkcache.server.cli import main
main(sys.argv[1:])
"""


def test_a_request_arriving_during_a_drain_is_told_the_server_is_stopping(model_dir: Path) -> None:
    """A request the HTTP server took but the engine loop had not admitted when the drain began
    is refused as `server_shutting_down` (a retry elsewhere helps), not as a dead engine."""
    import asyncio

    from chunkcache.sampling import SamplingParams
    from chunkcache.server.engine_loop import EngineLoop, ShuttingDownError
    from tests.support.engines import tiny_llm

    llm = tiny_llm(model_dir)

    async def run() -> None:
        loop = EngineLoop(llm.engine, max_queue=4)
        loop.start()
        try:
            loop.begin_drain(None)
            await asyncio.sleep(0.05)  # begin_drain is thread-safe: it lands on the event loop
            with pytest.raises(ShuttingDownError, match="shutting down"):
                await loop.submit("late", "hi", SamplingParams(max_tokens=1))
        finally:
            await loop.shutdown(0)

    asyncio.run(run())


def _wait_running(url: str, n: int, timeout: float = 60) -> None:
    """Until the server runs `n` requests (its /metrics gauge): on a loaded machine a request
    sent first may still be in intake when another has streamed its first token."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("chunkcache_num_requests_running ") and float(line.split()[1]) >= n:
                return
        time.sleep(0.05)
    raise AssertionError(f"the server never ran {n} requests at once")


@pytest.mark.server
def test_drain_timeout_ends_requests_with_openai_errors(model_dir: Path) -> None:
    """Issue 35: at the drain timeout a non-streamed request got uvicorn's text/plain 500 and a
    stream was cut with no error event and no [DONE]."""
    server = ServerProcess(
        ["--model", str(model_dir), *SERVE_ARGS, "--drain-timeout", "1"], script=_SLOW_SERVER
    )
    try:
        server.wait_healthy()
        body = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True}
        events: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with httpx.stream(
                "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line.removeprefix("data: "))
                        started.set()

        with ThreadPoolExecutor(2) as pool:
            plain = pool.submit(httpx.post, f"{server.url}/v1/completions", json=body, timeout=60)
            streamed = pool.submit(stream)
            assert started.wait(60)
            _wait_running(server.url, 2)  # the plain one admitted too, not refused by the drain
            server.proc.send_signal(signal.SIGTERM)
            r = plain.result(30)
            streamed.result(30)
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
        assert r.json()["error"]["code"] == "server_shutting_down" and "drain timeout" in r.text
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "server_shutting_down" and error["type"] == "service_unavailable"
        assert server.proc.wait(30) in (0, -signal.SIGTERM), server.output()
    finally:
        server.stop()


# ---- defect 7: the router and failing backends -----------------------------------------------


class RawBackend:
    """A TCP server that fails the way a killed backend does: `mode` "close" drops each connection
    before answering, "headers" sends a streaming 200 header block and then drops it."""

    def __init__(self, mode: str) -> None:
        import socket

        self.mode = mode
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.settimeout(5)
                try:
                    conn.recv(65536)
                    if self.mode == "headers":
                        conn.sendall(
                            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                            b"transfer-encoding: chunked\r\n\r\n"
                        )
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


def ok_backend(api_key: str | None = None) -> FastAPI:
    app = FastAPI()

    def authorized(request: Request) -> bool:
        return api_key is None or request.headers.get("authorization") == f"Bearer {api_key}"

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        if not authorized(request):
            return JSONResponse({"error": {"message": "no key"}}, status_code=401)
        return JSONResponse({"object": "list", "data": [{"id": "m", "object": "model"}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        if not authorized(request):
            return JSONResponse({"error": {"message": "no key"}}, status_code=401)
        if (await request.json()).get("stream"):

            async def events() -> Any:
                yield 'data: {"choices": [{"text": "ok"}]}\n\n'
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"choices": [{"text": "ok"}]})

    return app


def router_metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.server
def test_router_retries_backends_that_fail_before_sending(model_dir: Path) -> None:
    closing, headers_only = RawBackend("close"), RawBackend("headers")
    ok = ServerThread(ok_backend()).start()
    try:
        specs = (
            BackendSpec(closing.url, "closes"),
            BackendSpec(headers_only.url, "headers"),
            BackendSpec(ok.url, "ok"),
        )
        config = RouterConfig(specs, "m", str(model_dir), policy="round_robin", health_interval_s=0)
        with TestClient(create_app(Router(config))) as client:
            for stream in (False, True, False, True):
                r = client.post("/v1/completions", json={"prompt": "hi", "stream": stream})
                assert r.status_code == 200, r.text
                assert "ok" in r.text and "error" not in r.text
            big = json.dumps({"prompt": "x " * 3_000_000}).encode()  # over the router's 4 MiB default
            assert client.post("/v1/completions", content=big).status_code == 413
            text = client.get("/metrics").text
            assert router_metric(text, "chunkcache_router_requests_failed_total") == 0
            assert router_metric(text, 'chunkcache_router_proxy_errors_total{backend="closes"}') >= 1
            assert router_metric(text, 'chunkcache_router_proxy_errors_total{backend="headers"}') >= 1
    finally:
        closing.close()
        headers_only.close()
        ok.stop()


@pytest.mark.server
def test_router_reports_a_backend_killed_mid_stream(model_dir: Path) -> None:
    backend = ServerProcess(["--model", str(model_dir), *SERVE_ARGS])
    try:
        backend.wait_healthy()
        config = RouterConfig((BackendSpec(backend.url, "b1"),), "m", str(model_dir), health_interval_s=0)
        with TestClient(create_app(Router(config))) as client:
            body = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
            events: list[str] = []
            with client.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line.removeprefix("data: "))
                    if len(events) == 3:
                        backend.proc.kill()
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "backend_failed" and "mid-stream" in error["message"]
            text = client.get("/metrics").text
            assert router_metric(text, "chunkcache_router_requests_failed_total") == 1
    finally:
        backend.stop()


@pytest.mark.server
def test_router_api_key_guards_routes_and_is_forwarded(model_dir: Path) -> None:
    ok = ServerThread(ok_backend(api_key="k")).start()
    try:
        specs = (BackendSpec(ok.url, "ok"),)
        auth = {"Authorization": "Bearer k"}
        for open_metrics in (False, True):
            config = RouterConfig(
                specs, "m", str(model_dir), health_interval_s=0, api_key="k", open_metrics=open_metrics
            )
            with TestClient(create_app(Router(config))) as client:
                for method, path, body in (
                    ("GET", "/v1/models", None),
                    ("POST", "/v1/completions", {"prompt": "hi"}),
                    ("POST", "/score", {"prompt": "hi"}),
                ):
                    assert client.request(method, path, json=body).status_code == 401, path
                    wrong = {"Authorization": "Bearer nope"}
                    assert client.request(method, path, json=body, headers=wrong).status_code == 401
                    r = client.request(method, path, json=body, headers=auth)
                    assert r.status_code == 200, (path, r.text)
                assert client.get("/metrics").status_code == (200 if open_metrics else 401)
                assert client.get("/metrics", headers=auth).status_code == 200
                assert client.get("/health").status_code == 200
    finally:
        ok.stop()


# ---- defect 5: event-socket poisoning ------------------------------------------------------


def _publish_until(pub: Any, events: list[Any], cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Publish until `cond` holds (a SUB joins asynchronously); False if it never does."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pub.publish(events)
        time.sleep(0.05)
        if cond():
            return True
    return False


def test_bound_socket_takes_only_configured_backends_and_caps_claims() -> None:
    from chunkcache.kv_events import ChunkStored
    from chunkcache.kv_publisher import KVEventPublisher
    from chunkcache.router.events import EventIntake
    from chunkcache.router.index import MemoryIndex
    from chunkcache.router.pod_events import MAX_CHUNK_TOKENS
    from chunkcache.router.scorer import Scorer

    index = MemoryIndex()
    intake = EventIntake(index, num_workers=1, bind_endpoint="tcp://127.0.0.1:0", allowed_pods={"b1"})
    intake.start()
    evil = KVEventPublisher(intake.bound_endpoint, topic="kv@evil@m")
    real = KVEventPublisher(intake.bound_endpoint, topic="kv@b1@m")
    try:
        forged = [ChunkStored([111], [10**9]), ChunkStored([222], [MAX_CHUNK_TOKENS + 1])]
        assert _publish_until(evil, forged, lambda: intake.stats().unknown_topics > 0)
        assert _publish_until(
            real, [*forged, ChunkStored([333], [40])], lambda: bool(index.lookup_chunks([333])[0])
        )
        assert index.lookup_chunks([111, 222, 333]) == [{}, {}, {"b1": 40}]
        assert intake.stats().rejected_claims >= 2
        # Whatever a pod claims, a chunk earns at most its real length in the prompt.
        index.add_chunks("b1", [(444, 5000)])
        scores = Scorer(index).score([], [444, 333], ["b1"], chunk_tokens=[30, 40])
        assert scores["b1"].chunk_tokens == 70
    finally:
        evil.close()
        real.close()
        intake.close()


def _certificates(tmp_path: Path, names: list[str]) -> dict[str, tuple[Path, Path]]:
    """zmq.auth certificates: name -> (public key file, secret key file); public keys of the
    backends in tmp/backends, of the router in tmp/routers."""
    import zmq.auth

    out = {}
    for name in names:
        folder = tmp_path / ("routers" if name.startswith("router") else "backends")
        folder.mkdir(exist_ok=True)
        secret_dir = tmp_path / "secrets"
        secret_dir.mkdir(exist_ok=True)
        public, secret = zmq.auth.create_certificates(secret_dir, name)
        (folder / f"{name}.key").write_bytes(Path(public).read_bytes())
        out[name] = (folder / f"{name}.key", Path(secret))
    return out


def test_curve_authenticates_publishers_on_the_bound_socket(tmp_path: Path) -> None:
    from chunkcache.curve import CurveKeys, load_public_key
    from chunkcache.kv_events import ChunkStored
    from chunkcache.kv_publisher import KVEventPublisher, PublisherCurve
    from chunkcache.router.events import EventIntake, IntakeCurve
    from chunkcache.router.index import MemoryIndex

    certs = _certificates(tmp_path, ["router", "b1", "b2", "stranger"])
    (tmp_path / "backends" / "stranger.key").unlink()  # a key the router does not know
    router_public = load_public_key(certs["router"][0])
    index = MemoryIndex()
    intake = EventIntake(
        index,
        num_workers=1,
        bind_endpoint="tcp://127.0.0.1:0",
        allowed_pods={"b1", "b2"},
        curve=IntakeCurve(CurveKeys.load(certs["router"][1]), str(tmp_path / "backends")),
    )
    intake.start()

    def publisher(topic: str, key: str | None) -> KVEventPublisher:
        curve = (
            None if key is None else PublisherCurve(CurveKeys.load(certs[key][1]), server_key=router_public)
        )
        return KVEventPublisher(intake.bound_endpoint, topic=topic, curve=curve)

    plain, stranger, b2_as_b1, b1 = (
        publisher("kv@b1@m", None),
        publisher("kv@b1@m", "stranger"),
        publisher("kv@b1@m", "b2"),
        publisher("kv@b1@m", "b1"),
    )
    try:
        for pub in (plain, stranger):  # the CURVE handshake refuses them: nothing arrives
            assert not _publish_until(
                pub, [ChunkStored([1], [10])], lambda: bool(index.lookup_chunks([1])[0]), 1.0
            )
        # An authorized key speaking for another backend is dropped and counted.
        assert _publish_until(b2_as_b1, [ChunkStored([2], [10])], lambda: intake.stats().unknown_topics > 0)
        assert _publish_until(b1, [ChunkStored([3], [10])], lambda: bool(index.lookup_chunks([3])[0]))
        assert index.lookup_chunks([1, 2, 3]) == [{}, {}, {"b1": 10}]
    finally:
        for pub in (plain, stranger, b2_as_b1, b1):
            pub.close()
        intake.close()


def test_curve_on_connected_event_and_replay_sockets(tmp_path: Path) -> None:
    """The engine binds (CURVE server, the router's key authorized); the router connects."""
    from chunkcache.curve import CurveKeys
    from chunkcache.kv_events import ChunkStored
    from chunkcache.kv_publisher import KVEventPublisher, PublisherCurve
    from chunkcache.router.events import EventIntake, IntakeCurve
    from chunkcache.router.index import MemoryIndex

    certs = _certificates(tmp_path, ["router", "router-other", "b1"])
    (tmp_path / "routers" / "router-other.key").unlink()  # not authorized by the engine
    pub = KVEventPublisher(
        "tcp://127.0.0.1:0",
        topic="kv@b1@m",
        replay_endpoint="tcp://127.0.0.1:0",
        curve=PublisherCurve(CurveKeys.load(certs["b1"][1]), authorized_dir=str(tmp_path / "routers")),
    )
    # Published before any router listens: it can only arrive through the replay socket.
    pub.publish([ChunkStored([8], [10])])
    intakes = []
    try:
        for router in ("router", "router-other"):
            index = MemoryIndex()
            curve = IntakeCurve(CurveKeys.load(certs[router][1]), str(tmp_path / "backends"))
            it = EventIntake(index, num_workers=1, curve=curve)
            it.add_pod("b1", pub.endpoint, pub.replay_endpoint)
            it.start()
            intakes.append((it, index))
        (good, good_index), (bad, bad_index) = intakes
        assert _publish_until(pub, [ChunkStored([7], [10])], lambda: bool(good_index.lookup_chunks([7])[0]))
        assert good.wait_idle(10)
        assert good_index.lookup_chunks([8]) == [{"b1": 10}] and good.stats().replays >= 1
        assert bad_index.lookup_chunks([7, 8]) == [{}, {}] and bad.stats().batches == 0
    finally:
        for it, _ in intakes:
            it.close()
        pub.close()


# ---- defect 6: tenant isolation (cache_salt) ---------------------------------------------------


def test_cache_salt_separates_prefix_and_chunk_caches(inproc: ServerThread) -> None:
    engine = inproc.engine_loop.engine
    plain = "Zorvath sells apples in Ashford and Mirela lives in Port Kellam near the lanterns " * 3
    chunked = (
        "a system part seen only here # # the salted document one # # the salted document two # # question?"
    )

    def cached(http: httpx.Client, prompt: str, salt: str | None) -> int:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
        if salt is not None:
            body["cache_salt"] = salt
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    with httpx.Client(base_url=inproc.url, timeout=REQUEST_TIMEOUT) as http:
        for prompt in (plain, chunked):
            assert cached(http, prompt, "tenant-a") == 0
            assert cached(http, prompt, "tenant-b") == 0  # another tenant learns nothing
            assert cached(http, prompt, None) == 0
            assert cached(http, prompt, "tenant-a") > 0  # the same tenant reuses its KV
        r = http.post("/v1/completions", json={"prompt": "hi", "cache_salt": ""})
        assert r.status_code == 400 and error_of(r)["param"] == "cache_salt", r.text
    inproc.wait_idle()
    inproc.on_engine(engine.check_integrity)


def test_salted_blocks_are_never_published() -> None:
    blocks = BlockManager(8, 4, enable_prefix_caching=True, hash_seed="0", medium="GPU")
    tokens = list(range(1, 13))
    salted = blocks.allocate(3)
    blocks.register_full_blocks(salted, tokens, [], 12, BlockKeys(cache_salt="t"))
    assert blocks.events == [] and blocks.num_cached_blocks == 3
    assert blocks.match_prefix(tokens, 3) == ([], [])  # unsalted: no hit
    hit, _ = blocks.match_prefix(tokens, 3, BlockKeys(cache_salt="t"))
    assert hit == salted
    blocks.free(hit)
    blocks.free(salted)
    blocks.allocate(8)  # evicts every cached block: no BlockRemoved for the salted ones either
    assert blocks.events == []
    blocks.check_integrity()


@pytest.mark.server
def test_router_keys_chunks_by_salt(model_dir: Path) -> None:
    from chunkcache.hashing import chunk_hash, to_wire
    from chunkcache.router.tokens import PromptProcessor

    proc = PromptProcessor.from_pretrained(str(model_dir), "m")
    prompt = proc.tokenize("sys # # doc one # # doc two # # q?")
    plain, salted = proc.keys(prompt), proc.keys(prompt, cache_salt="t")
    assert not set(plain.chunk_keys) & set(salted.chunk_keys)
    sys_ids, first = prompt.prefix_token_ids, prompt.chunks[0]
    assert salted.chunk_keys[1] == to_wire(chunk_hash("m", sys_ids, first, cache_salt="t"))
    plain_prompt = proc.tokenize("a plain prompt " * 10)
    assert not set(proc.keys(plain_prompt).block_keys) & set(
        proc.keys(plain_prompt, cache_salt="t").block_keys
    )


# ---- defect 8: the index is rebuilt after Redis restarts ----------------------------------------


def test_block_state_events_list_parents_first() -> None:
    from chunkcache.hashing import block_hashes, to_wire

    blocks = BlockManager(8, 4, enable_prefix_caching=True, hash_seed="0", medium="GPU")
    tokens = list(range(1, 13))
    table = blocks.allocate(3)
    blocks.register_full_blocks(table, tokens, [], 12)
    blocks.register_full_blocks(table, tokens, [], 12, BlockKeys(cache_salt="t"))  # already cached: no change
    state = blocks.state_events()
    wire = [to_wire(h) for h in block_hashes("0", tokens, 4)]
    assert [e.block_hashes for e in state] == [[w] for w in wire]
    assert [e.parent_block_hash for e in state] == [None, *wire[:2]]
    assert state == [e for e in blocks.events]


@pytest.mark.server
@pytest.mark.redis
def test_router_index_recovers_after_a_redis_restart(model_dir: Path) -> None:
    from tests.support.redis_server import REDIS_BIN, RedisServer

    if REDIS_BIN is None:
        pytest.skip("redis-server is not on PATH (apt-get install redis-server)")
    import argparse
    import tempfile

    from chunkcache.engine_args import engine_options

    redis_dir = Path(tempfile.mkdtemp(prefix="faults-redis-"))
    redis = RedisServer(redis_dir)
    redis.start()
    argv = [
        "--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "--kv-cache-tokens", "2048", "--chunk-cache-size-gb", "0.01",
        "--kv-events-endpoint", "tcp://127.0.0.1:0", "--kv-events-replay-endpoint", "tcp://127.0.0.1:0",
        "--kv-events-topic", "kv@b1@m", "--served-model-name", "m",
    ]  # fmt: skip
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(argv)
    engine = LLMEngine(EngineConfig.from_options(args.model, use_env=False, **engine_options(args)))
    backend = ServerThread(build_app(engine, api_key=None, max_queue=8, served_model_name=None)).start()
    try:
        pub = engine.publisher
        assert pub is not None
        spec = BackendSpec(backend.url, "b1", pub.endpoint, pub.replay_endpoint)
        config = RouterConfig((spec,), "m", str(model_dir), index=redis.url, health_interval_s=0.2)
        rag = "You are a careful assistant # # the first document # # the second document # # which?"
        plain = "Zorvath sells apples in Ashford and Mirela lives in Port Kellam " * 4

        def scores() -> dict[str, Any]:
            out = {}
            for name, prompt in (("rag", rag), ("plain", plain)):
                r = client.post("/score", json={"prompt": prompt})
                out[name] = r.json()["scores"].get("b1", {}) if r.status_code == 200 else {}
            return out

        def recovered(timeout: float) -> dict[str, Any]:
            deadline = time.monotonic() + timeout
            while True:
                got = scores()
                if got["rag"].get("chunk_tokens", 0) > 0 and got["plain"].get("prefix_blocks", 0) > 0:
                    return got
                assert time.monotonic() < deadline, f"scores did not recover: {got}"
                time.sleep(0.1)

        router = Router(config)
        with TestClient(create_app(router)) as client:
            for prompt in (rag, plain):
                r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200, r.text
            before = recovered(20)
            resyncs = router.resyncs
            port = redis.port
            redis.stop()
            redis.start(port=port)  # empty: the index lost everything
            # Not "scores are 0 now": the router may notice and rebuild before a first look. What
            # shows the rebuild is the backend's re-publish, which only a lost state triggers.
            deadline = time.monotonic() + 20
            while router.resyncs == resyncs:
                assert time.monotonic() < deadline, "the router never asked the backend to re-publish"
                time.sleep(0.05)
            after = recovered(20)
            assert after == before
    finally:
        backend.stop()
        redis.stop()


def test_engine_curve_options_secure_its_publisher(model_dir: Path, tmp_path: Path) -> None:
    """`serve --kv-events-curve-*`: the engine's bound sockets take only the authorized router."""
    from chunkcache.curve import CurveKeys
    from chunkcache.router.events import EventIntake, IntakeCurve
    from chunkcache.router.index import MemoryIndex

    certs = _certificates(tmp_path, ["router", "b1"])
    with pytest.raises(ValueError, match="kv_events_curve_secret_key"):
        EngineConfig.from_options(str(model_dir), use_env=False, kv_events_curve_authorized_keys="x")
    engine = LLMEngine(
        EngineConfig.from_options(
            str(model_dir),
            use_env=False,
            device="cpu",
            kv_cache_tokens=512,
            kv_events_endpoint="tcp://127.0.0.1:0",
            kv_events_replay_endpoint="tcp://127.0.0.1:0",
            kv_events_topic="kv@b1@m",
            kv_events_curve_secret_key=str(certs["b1"][1]),
            kv_events_curve_authorized_keys=str(tmp_path / "routers"),
        )
    )
    index = MemoryIndex()
    intake = EventIntake(
        index,
        num_workers=1,
        curve=IntakeCurve(CurveKeys.load(certs["router"][1]), str(tmp_path / "backends")),
    )
    try:
        pub = engine.publisher
        assert pub is not None
        intake.add_pod("b1", pub.endpoint, pub.replay_endpoint)
        intake.start()
        n = 0
        deadline = time.monotonic() + 20
        while intake.stats().blocks_stored == 0:  # the SUB joins asynchronously: keep serving
            assert time.monotonic() < deadline, "no event reached the router over CURVE"
            n += 1
            engine.add_request(f"r{n}", [5 + n, *range(10, 50)], SamplingParams(max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
            time.sleep(0.05)
    finally:
        intake.close()
        engine.close()
