"""A bounded fault run against real processes: two `chunkcache serve` replicas behind `chunkcache
route` with a Redis index (issue 16's targets: 0 engine deaths, 0 hung or lost requests, 0 leaked
KV blocks, every bad input a 4xx).

Phases, each bounded in time: bad inputs; clients hanging up mid-stream; over-committed KV (prompt
+ max_tokens of several requests far beyond the KV cache); a backend killed under streaming load;
Redis restarted under load, then the index's recovery. Prints requests sent / failed / lost per
phase, leaked KV blocks, the surviving replica's RSS before and after, and one SUMMARY line.

The replicas serve a tiny random checkpoint (built in a temp dir, no download): the faults, not
the model, are under test. Run: `python benchmarks/bench_faults.py` (about two minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_router_cluster import Proc, free_port
from common import summary

# tests/support/tiny_checkpoint.py builds the random checkpoint (`common` put the repo root on sys.path).
from tests.support.tiny_checkpoint import build_checkpoint

MODEL = "m"
# One tiny-model RAG prompt: the router's scores of it must come back after Redis restarts.
RAG = "You answer from the documents # # Ashford sells apples # # Port Kellam has lanterns # # Who sells apples?"
BAD_BODIES: list[tuple[str, bytes]] = [
    (name, json.dumps(body).encode() if not isinstance(body, bytes) else body)
    for name, body in [
        ("tiny temperature", {"prompt": "hi", "max_tokens": 2, "temperature": 1e-38}),  # valid: greedy
        ("NaN temperature", b'{"prompt": "hi", "temperature": NaN}'),
        ("inf top_p", b'{"prompt": "hi", "top_p": Infinity}'),
        ("NaN blend_threshold", b'{"prompt": "hi", "blend_threshold": NaN}'),
        ("seed > 64 bits", {"prompt": "hi", "seed": 2**70}),
        ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}),
        ("max_tokens > KV cache", {"prompt": "hi", "max_tokens": 1500}),
        ("too many stops", {"prompt": "hi", "stop": [str(i) for i in range(40)]}),
        ("token out of vocab", {"prompt": [1, 10**9]}),
        ("empty prompt", {"prompt": ""}),
        ("unknown field", {"prompt": "hi", "best_of_all": 3}),
        ("bad chunk layout", {"prompt": "a # # b # # c", "chunk_layout": "diagonal"}),
        ("empty cache_salt", {"prompt": "hi", "cache_salt": ""}),
        ("not json", b"{not json"),
        ("not an object", b"[1, 2]"),
        ("body over the limit", json.dumps({"prompt": "x " * 600_000}).encode()),
        # Issue 35: each was a 500, accepted silently, or a 400 naming no field.
        ("lone surrogate", b'{"prompt": "hi \\ud800"}'),
        ("not UTF-8", b'{"prompt": "hi \xff"}'),
        ("logit_bias out of vocab", {"prompt": "hi", "logit_bias": {"100000": 1}}),
        ("logit_bias 5,000 digits", {"prompt": "hi", "logit_bias": {"9" * 5000: 1}}),
        ("stop_token_ids out of vocab", {"prompt": "hi", "stop_token_ids": [99_999_999]}),
        ("JSON nested 900 deep", b'{"prompt": "hi", "metadata": ' + b'{"a": ' * 900 + b"1" + b"}" * 901),
        ("JSON nested 100k deep", b"[" * 100_000 + b"]" * 100_000),
        ("1.8 MB prompt", {"prompt": "hello " * 300_000}),
    ]
]


@dataclass
class Phase:
    name: str
    sent: int = 0
    failed: int = 0  # ended with an error the client was told about
    lost: int = 0  # ended without an answer or an error (cut off, hung, 5xx before any byte)
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        extra = f" ({'; '.join(self.notes)})" if self.notes else ""
        return f"{self.name:<22} sent {self.sent:4d}  failed {self.failed:3d}  lost {self.lost:3d}{extra}"


async def stream(client: httpx.AsyncClient, body: dict, hang_up_after: int | None = None) -> str:
    """'ok', 'error' (an error event or status), 'hung_up', or 'lost' (cut off without a word)."""
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                return "error" if r.status_code < 500 or r.status_code in (502, 503) else "lost"
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    return "ok"
                if '"error"' in data:
                    return "error"
                events += 1
                if hang_up_after is not None and events >= hang_up_after:
                    return "hung_up"
            return "lost"
    except httpx.HTTPError:
        return "lost"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return float("nan")


def leaked_blocks(url: str, timeout: float = 30.0) -> int:
    """KV blocks still held once the replica is idle (0 expected)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics", timeout=5).text
        held = gauge(text, "chunkcache_kv_blocks") - gauge(text, "chunkcache_kv_blocks_free")
        if held == 0 or time.monotonic() > deadline:
            return int(held)
        time.sleep(0.2)


async def run(args: argparse.Namespace, work: Path) -> int:
    model = build_checkpoint(work / "model")
    redis_bin = shutil.which("redis-server")
    redis_port = free_port()
    redis_cmd = [redis_bin or "redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""]
    redis = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL) if redis_bin else None
    replicas: dict[str, Proc] = {}
    specs = []
    events_port = free_port()  # the router binds it; the replicas' PUB sockets connect
    for name in ("a", "b"):
        port, rp = free_port(), free_port()
        cmd = [
            sys.executable, "-m", "chunkcache.cli", "serve", "--model", str(model), "--port", str(port),
            "--device", "cpu", "--kv-cache-tokens", "1024", "--max-model-len", "2048",
            "--served-model-name", MODEL, "--log-level", "warning", "--drain-timeout", "5",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{rp}",
            "--kv-events-topic", f"kv@{name}@{MODEL}",
        ]  # fmt: skip
        replicas[name] = Proc(name, cmd, f"http://127.0.0.1:{port}", work)
        specs.append(f"{name}@http://127.0.0.1:{port}==tcp://127.0.0.1:{rp}")
    rport = free_port()
    index = f"redis://127.0.0.1:{redis_port}/0" if redis else "memory"
    router_cmd = [
        sys.executable, "-m", "chunkcache.cli", "route", "--backends", ",".join(specs), "--tokenizer", str(model),
        "--model-name", MODEL, "--index", index, "--health-interval", "0.5", "--port", str(rport),
        "--request-timeout", "60", "--events-bind", f"tcp://127.0.0.1:{events_port}",
    ]  # fmt: skip
    router = Proc("router", router_cmd, f"http://127.0.0.1:{rport}", work)
    procs = [*replicas.values(), router]
    phases: list[Phase] = []
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 300
        while not all(p.healthy() for p in procs):
            assert time.monotonic() < deadline, "the cluster did not come up"
            await asyncio.sleep(0.25)
        a = replicas["a"]
        assert a.proc is not None
        rss_before = rss_kib(a.proc.pid)
        async with httpx.AsyncClient(base_url=router.url, timeout=args.request_timeout) as client:
            # 1. Bad inputs, sent to each replica through the router several times.
            bad = Phase("bad inputs")
            for _ in range(args.repeat):
                for name, raw in BAD_BODIES:
                    bad.sent += 1
                    try:
                        r = await client.post(
                            "/v1/completions", content=raw, headers={"content-type": "application/json"}
                        )
                    except httpx.HTTPError:
                        bad.lost += 1
                        continue
                    expected_ok = name == "tiny temperature"
                    if (r.status_code == 200) != expected_ok or r.status_code >= 500:
                        bad.lost += 1
                        bad.notes.append(f"{name}: {r.status_code}")
                    elif not expected_ok:
                        bad.failed += 1  # a 4xx, as it should be
            phases.append(bad)

            # 2. Clients hanging up after their first event.
            hang = Phase("hang-ups")
            body = {"prompt": "tell me a story", "max_tokens": 200, "ignore_eos": True}
            results = await asyncio.gather(
                *(stream(client, body, hang_up_after=1) for _ in range(args.streams))
            )
            hang.sent = len(results)
            hang.lost = sum(r == "lost" for r in results)
            hang.failed = sum(r == "error" for r in results)
            phases.append(hang)

            # 3. Over-committed KV: each request alone fits, all together need several times the cache.
            over = Phase("over-committed KV")
            prompt = [5 + (i * 7) % 900 for i in range(260)]
            body = {"max_tokens": 600, "ignore_eos": True, "temperature": 0}
            results = await asyncio.gather(
                *(stream(client, {**body, "prompt": [6 + i, *prompt[1:]]}) for i in range(4))
            )
            over.sent, over.failed = len(results), sum(r == "error" for r in results)
            over.lost = sum(r == "lost" for r in results)
            phases.append(over)
            leaked_after_overcommit = sum(leaked_blocks(p.url) for p in replicas.values())

            # 4. A backend killed under streaming load: what had not started must be retried.
            kill = Phase("backend killed")
            body = {"prompt": "the story of the lanterns", "max_tokens": 150, "ignore_eos": True}

            async def killer() -> None:
                await asyncio.sleep(args.kill_after)
                b = replicas["b"].proc
                assert b is not None
                b.kill()

            async def staggered(i: int) -> str:
                # Spread over the kill: some start before it, some between it and B's ejection
                # (those must go to A), some after.
                await asyncio.sleep(i * 2 * args.kill_after / args.streams)
                return await stream(client, body)

            results, _ = await asyncio.gather(
                asyncio.gather(*(staggered(i) for i in range(args.streams))), killer()
            )
            kill.sent, kill.failed = len(results), sum(r == "error" for r in results)
            kill.lost = sum(r == "lost" for r in results)
            kill.notes.append(f"{sum(r == 'ok' for r in results)} finished")
            metrics = (await client.get("/metrics")).text
            failed_mid = gauge(metrics, "chunkcache_router_requests_failed_total")
            errors_b = gauge(metrics, 'chunkcache_router_proxy_errors_total{backend="b"}')
            kill.notes.append(
                f"router: {failed_mid:.0f} failed mid-stream, {errors_b:.0f} backend errors on b"
            )
            phases.append(kill)

            # 5. Redis restarted under load; then the index must know the RAG prompt's chunks again.
            rest = Phase("redis restarted")
            r = await client.post("/v1/completions", json={"prompt": RAG, "max_tokens": 2})
            assert r.status_code == 200, r.text

            async def rag_score() -> int | None:
                r = await client.post("/score", json={"prompt": RAG})
                return r.json()["scores"]["a"]["chunk_tokens"] if r.status_code == 200 else None

            before, t0 = 0, time.monotonic()
            while not before and time.monotonic() - t0 < 10:  # the events reach the index
                await asyncio.sleep(0.1)
                before = await rag_score()
            recovered_s = float("nan")
            if redis is not None:

                async def restart() -> None:
                    nonlocal redis
                    assert redis is not None
                    await asyncio.sleep(0.5)
                    redis.terminate()
                    redis.wait(10)
                    redis = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL)

                body = {"prompt": "a question about apples", "max_tokens": 20}
                results, _ = await asyncio.gather(
                    asyncio.gather(*(stream(client, body) for _ in range(args.streams))), restart()
                )
                rest.sent, rest.failed = len(results), sum(r == "error" for r in results)
                rest.lost = sum(r == "lost" for r in results)
                after = await rag_score()
                rest.notes.append(f"RAG chunk score {before} -> {after} right after the load")
                t0 = time.monotonic()
                while time.monotonic() - t0 < 20:
                    if await rag_score() == before:
                        recovered_s = time.monotonic() - t0
                        break
                    await asyncio.sleep(0.2)
                rest.notes.append(f"RAG chunk score {before} back after {recovered_s:.1f}s")
            else:
                rest.notes.append("skipped: no redis-server")
            phases.append(rest)
        leaked = leaked_blocks(a.url)
        rss_after = rss_kib(a.proc.pid)
        a_alive = a.proc.poll() is None and httpx.get(f"{a.url}/health", timeout=5).status_code == 200
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(30)
        if redis is not None:
            redis.terminate()
            redis.wait(10)

    print(f"replicas: tiny checkpoint, --kv-cache-tokens 1024 (64 blocks); index: {index}")
    for ph in phases:
        print(ph.line())
    print(f"leaked KV blocks: {leaked_after_overcommit} after over-commit (both), {leaked} at the end (a)")
    print(
        f"replica a RSS: {rss_before / 1024:.0f} MiB before, {rss_after / 1024:.0f} MiB after; alive: {a_alive}"
    )
    lost = sum(ph.lost for ph in phases)
    print(
        summary(
            "bench_faults",
            sent=str(sum(ph.sent for ph in phases)),
            failed=str(sum(ph.failed for ph in phases)),
            lost=str(lost),
            leaked_blocks=str(leaked_after_overcommit + leaked),
            engine_alive=str(a_alive),
            index_recovered_s=f"{recovered_s:.1f}",
        )
    )
    return 0 if lost == 0 and leaked == 0 and a_alive else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=24, help="concurrent streams per load phase")
    parser.add_argument("--repeat", type=int, default=3, help="times each bad input is sent")
    parser.add_argument("--kill-after", type=float, default=1.5, help="seconds into the load before the kill")
    parser.add_argument("--request-timeout", type=float, default=120.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        return asyncio.run(run(args, Path(tmp)))


if __name__ == "__main__":
    sys.exit(main())
