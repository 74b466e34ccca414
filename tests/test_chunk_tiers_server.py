"""Server processes sharing chunk KV through the lower tiers: a restart over the same disk
directory, and a second replica over the same real `redis-server`."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
from redis_server import RedisServer, redis_server  # noqa: F401 (fixture)
from server_util import ServerProcess

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
    redis_server: RedisServer,  # noqa: F811
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
    finally:
        restarted.stop()
        replica.stop()


def server_tokens(server: ServerProcess, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(f"{server.url}/tokenize", json=body, timeout=10).json()["tokens"]
