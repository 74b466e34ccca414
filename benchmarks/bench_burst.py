"""A burst of warm real-shape RAG requests through the server: each alone, then all at once (issue 57).

Eight users ask at the same moment, each over N long, alike documents the server has seen (the
real-shape set's held-out questions, two per type, benchmarks/rag_shape_set.py). Issue 57's target:
their median time to first token no worse than serving them one after another, i.e. at most 4.5x
one request's alone (the median of 1..8 requests' queueing), better where batching pays.

Per side (a `chunkcache serve` with its defaults, and one with extra options: by default
`--max-long-partial-prefills 64`, every long prefill a piece per step, the scheduler before long
prefills were served first come first served), per round: the documents warmed (each prompt's
documents in reverse order, one token), then each request alone, one after another, then all of
them at once (the same prompts: fusion streams never read each other's question rows, so the burst
recomputes what the alone requests computed). Reported: TTFT alone (median), the median a queue
would give (each request after the ones before it, their whole replies), the burst's median and
slowest, the ratios, the wall time, and how many burst replies equal the same request's alone
(batch composition may move a bfloat16 result). Sides alternate per round, one server works at a
time.

    python benchmarks/bench_burst.py --threads 2
    python benchmarks/bench_burst.py --rounds 2 --sides default,shared --shared-args "--max-long-partial-prefills 64"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from bench_serve import ServerProcess
from common import describe_machine, summary

from chunkcache.fidelity import rag_shape as rs
from chunkcache.fidelity.measure import render

SEPARATOR = " # # "


@dataclass
class Reply:
    ttft: float
    e2e: float
    text: str


@dataclass
class SideRuns:
    alone: list[list[Reply]] = field(default_factory=list)  # per round, per request
    burst: list[list[Reply]] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)


def prompts(tokenizer: object, n: int, size: int, count: int) -> list[tuple[str, str]]:
    """(prompt, the same documents reversed) for `count` held-out questions with `n` documents of
    ~`size` tokens, the types taken in turn."""
    records = rs.load_records()
    by_type: dict[str, list[rs.RagQuestion]] = {}
    for q in rs.load():
        if q.n == n and q.split == "heldout":
            by_type.setdefault(q.kind, []).append(q)
    chosen = [q for group in zip(*(by_type[k] for k in rs.KINDS), strict=False) for q in group][:count]
    out = []
    for q in chosen:
        docs = q.documents(records, size)
        out.append(
            (
                render(tokenizer, docs, q.question, SEPARATOR),
                render(tokenizer, docs[::-1], q.question, SEPARATOR),
            )
        )
    return out


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> Reply:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    ttft, text = None, ""
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and event["choices"][0].get("text"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
                text += event["choices"][0]["text"]
    if ttft is None:
        raise RuntimeError("no token received")
    return Reply(ttft, time.perf_counter() - start, text)


async def run_round(url: str, cases: list[tuple[str, str]], max_tokens: int, runs: SideRuns) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        for _, reverse in cases:  # the documents warm, not the prompts
            await one(client, reverse, 1)
        runs.alone.append([await one(client, prompt, max_tokens) for prompt, _ in cases])
        start = time.perf_counter()
        runs.burst.append(list(await asyncio.gather(*(one(client, p, max_tokens) for p, _ in cases))))
        runs.walls.append(time.perf_counter() - start)


def queued_median(alone: list[Reply]) -> float:
    """The median TTFT had the requests been served one after another in this order."""
    waited, ttfts = 0.0, []
    for reply in alone:
        ttfts.append(waited + reply.ttft)
        waited += reply.e2e
    return statistics.median(ttfts)


def figures(runs: SideRuns) -> dict[str, float]:
    alone = statistics.median(r.ttft for rnd in runs.alone for r in rnd)
    queued = statistics.median(queued_median(rnd) for rnd in runs.alone)
    burst = statistics.median(statistics.median(r.ttft for r in rnd) for rnd in runs.burst)
    slowest = statistics.median(max(r.ttft for r in rnd) for rnd in runs.burst)
    same = sum(
        a.text == b.text
        for ra, rb in zip(runs.alone, runs.burst, strict=True)
        for a, b in zip(ra, rb, strict=True)
    )
    return {
        "alone": alone,
        "queued": queued,
        "burst": burst,
        "slowest": slowest,
        "wall": statistics.median(runs.walls),
        "same": same,
        "total": sum(map(len, runs.burst)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--n", type=int, default=8, choices=(4, 8, 16), help="documents per prompt")
    parser.add_argument("--size", type=int, default=500, choices=rs.SIZES, help="tokens per document, about")
    parser.add_argument("--requests", type=int, default=8, help="requests in the burst (held-out questions)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sides", default="default,shared")
    parser.add_argument(
        "--shared-args", default="--max-long-partial-prefills 64", help="the second side's options"
    )
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from chunkcache.model.loader import model_path

    gguf = Path(model_path(args.model))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cases = prompts(tokenizer, args.n, args.size, args.requests)
    names = [s.strip() for s in args.sides.split(",") if s.strip()]
    extra = {"default": [], "shared": shlex.split(args.shared_args)}
    log_dir = Path(tempfile.mkdtemp(prefix="bench-burst-"))
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    print(
        f"{cpu}; {describe_machine()}\n{len(cases)} requests of {args.n} x ~{args.size} tokens; logs in {log_dir}"
    )
    servers = {
        name: ServerProcess(Path(args.model), True, ["--threads", str(args.threads), *extra[name]], log_dir)
        for name in names
    }
    for name, server in servers.items():
        server.log_path = log_dir / f"server-{name}.log"
    runs = {name: SideRuns() for name in names}
    try:
        for server in servers.values():
            server.start(timeout=1800)
        for k in range(args.rounds):
            for name in names if k % 2 == 0 else names[::-1]:
                print(f"round {k + 1}: {name}", flush=True)
                asyncio.run(run_round(servers[name].url, cases, args.max_tokens, runs[name]))
    finally:
        for server in servers.values():
            server.stop()
    return report(runs, args)


def report(runs: dict[str, SideRuns], args: argparse.Namespace) -> int:
    print(
        f"\n{'side':<10}{'alone':>9}{'queued':>9}{'burst':>9}{'slowest':>9}{'x alone':>9}{'x queued':>10}{'wall':>8}  same replies"
    )
    parts: dict[str, str] = {}
    for name, side in runs.items():
        f = figures(side)
        print(
            f"{name:<10}{f['alone']:>9.2f}{f['queued']:>9.2f}{f['burst']:>9.2f}{f['slowest']:>9.2f}"
            f"{f['burst'] / f['alone']:>8.2f}x{f['burst'] / f['queued']:>9.2f}x{f['wall']:>8.1f}  {f['same']}/{f['total']}"
        )
        parts[f"burst_over_alone_{name}"] = f"{f['burst'] / f['alone']:.2f}x"
        parts[f"burst_over_queued_{name}"] = f"{f['burst'] / f['queued']:.2f}x"
        parts[f"slowest_over_median_{name}"] = f"{f['slowest'] / f['burst']:.2f}x"
        parts[f"same_replies_{name}"] = f"{f['same']}/{f['total']}"
        if name == "default":
            parts["target_burst"] = "<=4.5x_alone:" + ("met" if f["burst"] <= 4.5 * f["alone"] else "MISSED")
    if {"default", "shared"} <= set(runs):
        parts["burst_shared_over_default"] = (
            f"{figures(runs['shared'])['burst'] / figures(runs['default'])['burst']:.2f}x"
        )
    print(
        summary(
            "bench_burst",
            **parts,
            requests=str(args.requests),
            shape=f"{args.n}x{args.size}",
            threads=str(args.threads),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
