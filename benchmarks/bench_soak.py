"""Many RAG requests at a fixed concurrency through the server: errors, leaks, resident memory (issue 57).

Issue 57's target: 1,000 requests at concurrency 16, 0 errors, 0 engine restarts, KV blocks and
chunk pool back to their idle counts afterwards, resident memory flat after the first 50. The
workload: a corpus of `--corpus` real-shape documents (one `mendeleev` element each, ~`--size`
tokens, benchmarks/rag_shape_set.py's material), each request `--k-min`..`--k-max` of them drawn by
Zipf popularity (`--zipf`) in random order, a question about one of them, `--max-tokens` out;
every `--abort-every`-th request is a streamed one the client drops after its first token (its
streams must be freed at once). The server's resident memory (VmRSS) is read after every 10
requests; after the last, `/metrics` and `/v1/chunk_cache/stats` must show every KV block free,
no request running or waiting and no pinned chunk entry.

    python benchmarks/bench_soak.py --model smollm2 --requests 1000 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx
from bench_serve import ServerProcess
from common import summary
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from chunkcache.fidelity import rag_shape as rs

SEPARATOR = " # # "
SYSTEM = "You are a helpful assistant. Answer the question from the documents."


def prompts(args: argparse.Namespace) -> list[str]:
    """The requests' prompts: documents by Zipf popularity, random order, a question on one."""
    rng = random.Random(args.seed)
    records = rs.load_records()
    corpus = rng.sample(rs.pool(records), args.corpus)
    weights = [1 / (rank + 1) ** args.zipf for rank in range(len(corpus))]
    out = []
    for _ in range(args.requests):
        k = rng.randint(args.k_min, args.k_max)
        chosen: list[int] = []
        while len(chosen) < k:
            n = rng.choices(corpus, weights)[0]
            if n not in chosen:
                chosen.append(n)
        asked = records[rng.choice(chosen)]
        docs = [records[n].document(args.size) for n in chosen]
        out.append(SEPARATOR.join([SYSTEM, *docs, f"What is the atomic number of {asked.name}?"]))
    return out


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int, drop: bool) -> str | None:
    """None when served (or dropped after its first token, as asked); else the error."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]" and drop:
                    return None  # the client hangs up mid-stream
                if line.startswith("data: ") and '"error"' in line:
                    return line[:200]
        return None
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"


def idle_state(url: str) -> dict[str, float]:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    values = {s.name: s.value for family in text_string_to_metric_families(metrics) for s in family.samples}
    chunks = httpx.get(f"{url}/v1/chunk_cache/stats", timeout=30).json()
    return {
        "kv_blocks_free": values.get("chunkcache_kv_blocks_free", float("nan")),
        "kv_blocks": values.get("chunkcache_kv_blocks", float("nan")),
        "running": values.get("chunkcache_num_requests_running", float("nan")),
        "waiting": values.get("chunkcache_num_requests_waiting", float("nan")),
        "pinned_entries": float(chunks.get("pinned_entries", float("nan"))),
        "pool_gb": chunks.get("bytes", 0) / 2**30,  # what the chunk pool holds (its pages touched)
        "pool_budget_gb": chunks.get("budget_bytes", 0) / 2**30,
    }


async def soak(
    server: ServerProcess, texts: list[str], args: argparse.Namespace
) -> tuple[list[str], list[int]]:
    assert server.proc is not None
    errors: list[str] = []
    rss: list[int] = []
    semaphore = asyncio.Semaphore(args.concurrency)
    bar = tqdm(total=len(texts), desc="requests", unit="req")
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=server.url, timeout=3600, limits=limits) as client:

        async def bounded(i: int, text: str) -> None:
            async with semaphore:
                drop = args.abort_every > 0 and i % args.abort_every == args.abort_every - 1
                if (error := await one(client, text, args.max_tokens, drop)) is not None:
                    errors.append(error)
            bar.update(1)
            if bar.n % 10 == 0:
                rss.append(rss_bytes(server.proc.pid))  # type: ignore[union-attr]

        await asyncio.gather(*(bounded(i, t) for i, t in enumerate(texts)))
    bar.close()
    return errors, rss


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--corpus", type=int, default=64, help="documents in the corpus")
    parser.add_argument("--size", type=int, default=300, choices=rs.SIZES, help="tokens per document, about")
    parser.add_argument("--k-min", type=int, default=4)
    parser.add_argument("--k-max", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--abort-every", type=int, default=10, help="every n-th request dropped mid-stream")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=57)
    args, server_args = parser.parse_known_args()
    texts = prompts(args)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-soak-"))
    server = ServerProcess(Path(args.model), True, ["--threads", str(args.threads), *server_args], log_dir)
    print(
        f"{args.requests} requests at concurrency {args.concurrency} on {args.model}; server log {server.log_path}"
    )
    try:
        server.start(timeout=1800)
        assert server.proc is not None
        loaded = rss_bytes(server.proc.pid)
        started = time.perf_counter()
        errors, rss = asyncio.run(soak(server, texts, args))
        seconds = time.perf_counter() - started
        time.sleep(2)  # the last aborts reach the engine
        idle = idle_state(server.url)
        alive = server.proc.poll() is None
    finally:
        server.stop()
    return report(args, loaded, rss, errors, idle, alive, seconds)


def report(
    args, loaded: int, rss: list[int], errors: list[str], idle: dict, alive: bool, seconds: float
) -> int:  # type: ignore[no-untyped-def]
    gb = 2**30
    after_50 = rss[min(4, len(rss) - 1)]  # the sample after request 50
    growth = (rss[-1] - after_50) / gb
    print(
        f"RSS after load {loaded / gb:.2f} GB; after 50 requests {after_50 / gb:.2f} GB; at the end {rss[-1] / gb:.2f} GB"
    )
    print("RSS every 10 requests (GB): " + " ".join(f"{x / gb:.2f}" for x in rss))
    print(f"idle after: {json.dumps(idle)}")
    for error in errors[:5]:
        print(f"error: {error}")
    idle_ok = idle["kv_blocks_free"] == idle["kv_blocks"] and not idle["running"] and not idle["waiting"]
    idle_ok = idle_ok and idle["pinned_entries"] == 0
    print(
        summary(
            "bench_soak",
            requests=str(args.requests),
            concurrency=str(args.concurrency),
            errors=str(len(errors)),
            server_alive=str(alive),
            idle_restored=str(idle_ok),
            rss_load_gb=f"{loaded / gb:.2f}",
            rss_after50_gb=f"{after_50 / gb:.2f}",
            rss_end_gb=f"{rss[-1] / gb:.2f}",
            rss_growth_after50_gb=f"{growth:.3f}",
            req_per_s=f"{args.requests / seconds:.2f}",
            model=args.model,
        )
    )
    return 0 if not errors and alive and idle_ok else 1


if __name__ == "__main__":
    sys.exit(main())
