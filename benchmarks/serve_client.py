"""bench_serve's client: streamed completions sent at a fixed concurrency or at Poisson arrival times.

Every request is `POST /v1/completions` with the prompt text, greedy, `max_tokens` forced by
`ignore_eos` (chunkcache and llama-server both read it), streamed with `stream_options.include_usage`
so that the last event carries the usage (prompt, completion and cached tokens) on both sides.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import httpx
from serve_metrics import RequestResult


def client_for(url: str, timeout_s: float) -> httpx.AsyncClient:
    """No connection limit: the run decides how many requests are in flight. No keep-alive: a
    connection per request (loopback, a fraction of a millisecond), since a pooled one that the
    server closes as it is reused fails the request ("Server disconnected without sending a
    response"; llama-server did that to 2 of 24 requests at concurrency 1)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(timeout_s), limits=limits)


def read_usage(result: RequestResult, usage: dict) -> None:
    result.prompt_tokens = usage.get("prompt_tokens", 0)
    result.output_tokens = usage.get("completion_tokens", 0)
    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> RequestResult:
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last: float | None = None
    events = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                if event.get("usage"):
                    read_usage(result, event["usage"])
                if not event.get("choices") or not event["choices"][0].get("text"):
                    continue
                events += 1
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
        result.e2e = time.perf_counter() - start
        result.output_tokens = result.output_tokens or events  # a side without usage: its events
        result.ok = last is not None
        if not result.ok:
            result.error = "no token received"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def at_concurrency(
    client: httpx.AsyncClient,
    work: list[tuple[str, int]],
    concurrency: int,
    done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestResult], float]:
    """(prompt, max_tokens) pairs, at most `concurrency` in flight; results in order, and the wall
    time from the first send to the last answer."""
    semaphore = asyncio.Semaphore(concurrency)

    async def bounded(prompt: str, max_tokens: int) -> RequestResult:
        async with semaphore:
            result = await one_request(client, prompt, max_tokens)
        done()
        return result

    start = time.perf_counter()
    results = await asyncio.gather(*(bounded(p, n) for p, n in work))
    return list(results), time.perf_counter() - start


async def at_times(
    client: httpx.AsyncClient,
    work: list[tuple[str, int]],
    offsets: list[float],
    done: Callable[[], None] = lambda: None,
) -> tuple[list[RequestResult], float]:
    """Each request sent `offsets[i]` seconds after the start (less the first offset), none held
    back; results in order, and the wall time from the start to the last answer."""
    base = offsets[0] if offsets else 0.0
    start = time.perf_counter()

    async def timed(prompt: str, max_tokens: int, at: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + at - base - time.perf_counter()))
        result = await one_request(client, prompt, max_tokens)
        done()
        return result

    results = await asyncio.gather(*(timed(p, n, t) for (p, n), t in zip(work, offsets, strict=True)))
    return list(results), time.perf_counter() - start
