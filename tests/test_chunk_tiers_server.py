"""Server processes sharing chunk KV through the lower tiers: a restart over the same disk
directory, and a second replica over the same real `redis-server`."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from chunkcache.config import EngineConfig
from chunkcache.engine.engine import LLMEngine
from chunkcache.server.app import build_app
from tests.support.redis_server import RedisServer
from tests.support.server_util import ServerProcess, ServerThread

pytestmark = pytest.mark.server
PROMPT = (
    "You answer questions about the documents. # # Alice lives in Paris and drinks tea. # # "
    "Bob was born in 1990 in Rome, the capital of Italy. # # Carol keeps three cats. # # Who drinks tea?"
)
ARGS = ["--device", "cpu", "--kv-cache-tokens", "1024", "--max-model-len", "256"]
ARGS += ["--chunk-cache-size-gb", "0.01", "--chunk-layout", "isolated", "--log-level", "warning"]


def _complete(server: ServerProcess) -> openai.types.Completion:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    return client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2
    )


def _tier_stats(server: ServerProcess) -> dict:
    return httpx.get(f"{server.url}/v1/chunk_cache/stats", timeout=10).json()["tiers"]


def test_restart_and_second_replica_load_the_first_ones_documents(
    checkpoint: Callable[..., Path],
    tmp_path: Path,
    redis_server: RedisServer,
) -> None:
    model = ["--model", str(checkpoint("qwen3"))]
    disk = ["--chunk-cache-disk-dir", str(tmp_path / "kv")]
    remote = ["--chunk-cache-remote", redis_server.url]
    first = ServerProcess([*model, *ARGS, *disk, *remote]).wait_healthy()
    try:
        cold = _complete(first)
        assert cold.usage.prompt_tokens_details.cached_tokens == 0
        # SIGTERM: a graceful shutdown finishes the tiers' writes before the process exits.
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(60) in (0, -signal.SIGTERM), first.output()
    finally:
        first.stop()
    # Both at once: a restart over the same directory, and a replica that only shares Redis.
    restarted = ServerProcess([*model, *ARGS, *disk])
    replica = ServerProcess([*model, *ARGS, *remote])
    try:
        for server, medium in ((restarted.wait_healthy(), "disk"), (replica.wait_healthy(), "remote")):
            warm = _complete(server)
            # Every token but the question's came from the tier.
            assert warm.usage.prompt_tokens_details.cached_tokens > 0
            assert warm.usage.prompt_tokens - warm.usage.prompt_tokens_details.cached_tokens == len(
                server_tokens(server, "Who drinks tea?")
            )
            assert warm.choices[0].text == cold.choices[0].text
            assert warm.choices[0].logprobs.token_logprobs == cold.choices[0].logprobs.token_logprobs
            stats = _tier_stats(server)[medium]
            assert stats["hits"] == 4 and stats["misses"] == 0 and stats["corrupt"] == 0
            metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
            assert f'chunkcache_chunk_tier_hits_total{{tier="{medium}"}} 4.0' in metrics
            assert f'chunkcache_chunk_tier_load_seconds_count{{tier="{medium}"}} 4.0' in metrics
            assert (
                f'chunkcache_chunk_tier_bytes_loaded_total{{tier="{medium}"}} {stats["bytes_loaded"]:.1f}'
                in metrics
            )
    finally:
        restarted.stop()
        replica.stop()


def server_tokens(server: ServerProcess, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(f"{server.url}/tokenize", json=body, timeout=10).json()["tokens"]


def test_prewarm_endpoint_and_tier_metrics(checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    options = {
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_tokens": 1024,
        "max_model_len": 256,
        "chunk_layout": "isolated",
    }
    options["chunk_cache_disk_dir"] = str(tmp_path)
    engine = LLMEngine(EngineConfig.from_options(str(checkpoint("qwen3")), use_env=False, **options))
    server = ServerThread(build_app(engine, api_key=None, max_queue=8, served_model_name="m")).start()
    try:
        system, *documents, _ = PROMPT.split(" # # ")
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/chunk_cache/prewarm", json={"system": system, "documents": documents})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["cached_tokens"] == 0 and body["computed_tokens"] == body["prompt_tokens"] > 0
            again = http.post("/v1/chunk_cache/prewarm", json={"prompt": PROMPT, "model": "m"}).json()
            assert again["cached_tokens"] == again["prompt_tokens"] and again["computed_tokens"] == 0
            for bad, message in (
                ({"prompt": PROMPT, "system": system}, "not both"),
                ({"prompt": "no separator here"}, "not a chunked prompt"),
                ({"system": system, "documents": []}, "non-empty list of documents"),
                ({"prompt": PROMPT, "question": "?"}, "question"),
                ({"prompt": PROMPT, "model": "other"}, "other"),
            ):
                r = http.post("/v1/chunk_cache/prewarm", json=bad)
                assert 400 <= r.status_code < 500 and message in r.text, (bad, r.status_code, r.text)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="m", prompt=PROMPT, max_tokens=4, temperature=0)
        assert out.usage.prompt_tokens_details.cached_tokens == body["prompt_tokens"]
        stats = server.wait_idle()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        server.on_engine(engine.check_integrity)
        server.on_engine(engine.flush_chunk_tiers)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'chunkcache_chunk_tier_stores_total{tier="disk"} 4.0' in metrics  # S and 3 documents
        assert 'chunkcache_chunk_tier_entries{tier="disk"} 4.0' in metrics
        assert 'chunkcache_chunk_tier_load_seconds_count{tier="disk"} 0.0' in metrics  # all in the pool
        assert 'chunkcache_chunk_tier_writes_stopped{tier="disk"} 0.0' in metrics
    finally:
        server.stop()


def test_prewarm_total_size_is_capped(checkpoint: Callable[..., Path]) -> None:
    """Issue 35: nothing capped a prewarm's size (256 documents of up to 8,192 tokens), and one
    held the engine for minutes. Over `max_prewarm_tokens` it is a 400 naming the field and limit."""
    options = {"device": "cpu", "kv_cache_tokens": 1024, "max_model_len": 256, "chunk_cache_size_gb": 0.01}
    engine = LLMEngine(EngineConfig.from_options(str(checkpoint("qwen3")), use_env=False, **options))
    app = build_app(engine, api_key=None, max_queue=8, served_model_name="m", max_prewarm_tokens=64)
    server = ServerThread(app).start()
    try:
        system, *documents, _ = PROMPT.split(" # # ")
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post("/v1/chunk_cache/prewarm", json={"system": system, "documents": documents[:1]})
            assert r.status_code == 200, r.text
            tokens = r.json()["prompt_tokens"]
            assert tokens <= 64
            r = http.post("/v1/chunk_cache/prewarm", json={"system": system, "documents": documents * 3})
            assert r.status_code == 400 and r.json()["error"]["param"] == "documents", r.text
            assert "--max-prewarm-tokens" in r.text and "(64" in r.text
            r = http.post(
                "/v1/chunk_cache/prewarm", json={"prompt": " # # ".join([system, *documents * 3, "?"])}
            )
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
            # Far too much text is refused before it is tokenized.
            r = http.post("/v1/chunk_cache/prewarm", json={"system": system, "documents": ["word " * 20_000]})
            assert r.status_code == 400 and "before tokenizing" in r.text, r.text
        server.wait_idle()
    finally:
        server.stop()


def test_prewarm_can_return_early_and_be_cancelled(checkpoint: Callable[..., Path]) -> None:
    """`"wait": false`: 202 with the job's id and a Location at once, its state at GET (running,
    then completed with the same counts a waiting call gets); DELETE cancels one; a failed one
    says why. Either way every KV block, pin and fill job comes back."""
    from chunkcache.core.sequence import SequenceKind

    options = {
        "device": "cpu",
        "dtype": "float32",
        "kv_cache_tokens": 2048,
        "max_model_len": 256,
        "chunk_cache_size_gb": 0.01,
        "max_num_batched_tokens": 16,
        "long_prefill_token_threshold": 8,  # a prewarm of many steps
    }
    engine = LLMEngine(EngineConfig.from_options(str(checkpoint("qwen3")), use_env=False, **options))
    server = ServerThread(build_app(engine, api_key=None, max_queue=8, served_model_name="m")).start()
    run = engine.runner.run

    def failing_on(word: str):  # a step holding a fill job of a document with `word` raises
        def step(batch):
            for seq in batch.seqs:
                if seq.kind.is_fill and word in engine.tokenizer.decode(seq.token_ids):
                    raise RuntimeError(f"injected on {word}")
            return run(batch)

        return step

    def held_on(word: str, release: threading.Event):  # such a step waits for `release`
        def step(batch):
            if any(s.kind.is_fill and word in engine.tokenizer.decode(s.token_ids) for s in batch.seqs):
                assert release.wait(60), "never released"
            return run(batch)

        return step

    def docs(tag: str) -> list[str]:
        return [f"{tag} document {i}: " + " ".join(f"{tag} fact {j}." for j in range(20)) for i in range(6)]

    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            r = http.post(
                "/v1/chunk_cache/prewarm", json={"system": "S.", "documents": docs("alpha"), "wait": False}
            )
            assert r.status_code == 202, r.text
            job = r.json()
            assert job["status"] == "running" and job["object"] == "chunk_cache.prewarm"
            assert r.headers["location"] == f"/v1/chunk_cache/prewarm/{job['id']}"
            while (state := http.get(r.headers["location"]).json())["status"] == "running":
                time.sleep(0.05)
            assert state["status"] == "completed" and state["error"] is None
            assert state["cached_tokens"] == 0 and state["computed_tokens"] == state["prompt_tokens"] > 0
            again = http.post("/v1/chunk_cache/prewarm", json={"system": "S.", "documents": docs("alpha")})
            assert again.json()["prompt_tokens"] == state["prompt_tokens"] == again.json()["cached_tokens"]

            r = http.get("/v1/chunk_cache/prewarm/prewarm-nonexistent")
            assert r.status_code == 404 and r.json()["error"]["param"] == "prewarm_id", r.text

            release = threading.Event()  # the prewarm is still running when DELETE comes
            engine.runner.run = held_on("beta", release)  # type: ignore[method-assign]
            body = {"system": "S.", "documents": docs("beta"), "wait": False}
            job = http.post("/v1/chunk_cache/prewarm", json=body).json()
            try:
                cancelled = http.delete(f"/v1/chunk_cache/prewarm/{job['id']}").json()
            finally:
                release.set()
            assert cancelled["status"] == "cancelled", cancelled
            assert http.get(f"/v1/chunk_cache/prewarm/{job['id']}").json()["status"] == "cancelled"

            engine.runner.run = failing_on("gamma")  # type: ignore[method-assign]
            body = {"system": "S.", "documents": docs("gamma"), "wait": False}
            job = http.post("/v1/chunk_cache/prewarm", json=body).json()
            while (state := http.get(f"/v1/chunk_cache/prewarm/{job['id']}").json())["status"] == "running":
                time.sleep(0.05)
            assert state["status"] == "failed" and "injected on gamma" in state["error"], state
        stats = server.wait_idle()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        server.on_engine(engine.check_integrity)
        pool = engine.chunks.pool
        assert all(e.pins == 0 and e.ready for e in pool.entries())
        assert engine.chunk_cache_stats()["jobs_running"] == 0
        assert not [s for s in engine.scheduler.waiting if s.kind is SequenceKind.PREWARM_FILL]
    finally:
        server.stop()
