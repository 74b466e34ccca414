"""Serving benchmark in the manner of `vllm bench serve`, on a RAG workload, chunk cache on vs off.

The script starts `chunkcache serve` itself (one server process per mode, both up at once, on the
same model) and drives them over HTTP with streaming completions at a fixed concurrency, in
interleaved rounds: the request list is cut into `--rounds` consecutive slices, and each slice runs
on one server, then on the other, the order alternating per round, so that a drift of the
machine's load hits both modes alike (each server still sees every request, in the same order).
Only one server works at a time; the ratio of each round is reported too, as its spread. The workload is retrieval-augmented generation: a pool of documents recurs in
different combinations and orders, each prompt being `system # # doc # # ... # # question`. The
prefix cache only helps when two prompts start with the same documents in the same order; the
chunk cache reuses every document it has seen, wherever it sits.

Reported per mode: TTFT, TPOT (time per output token after the first), ITL (gaps between streamed
chunks) as mean / p50 / p99, request and output-token throughput, and the prompt tokens served from
cache. The last line is grep-able:

    SUMMARY bench_serve: ttft_mean_ratio_off_on=...x ttft_p50_ratio_off_on=...x ...

Usage:
    python benchmarks/bench_serve.py                      # builds a small random checkpoint
    python benchmarks/bench_serve.py --model DIR --concurrency 8 --num-requests 64
    python benchmarks/bench_serve.py -- --device cuda     # args after -- go to both servers
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
SEPARATOR = " # # "
SYSTEM = "You are a helpful assistant. Answer the question from the documents."
# The default model: the tiny recipe widened and deepened until a prefill costs real compute, so
# the TTFT difference measures attention/MLP work saved, not HTTP overhead. Random weights.
SMALL_OVERRIDES: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 768,
    "max_position_embeddings": 4096,
}


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class ModeResult:
    name: str
    results: list[RequestResult]
    duration: float
    chunk_stats: dict[str, Any]

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method), 0 <= q <= 100."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(values: list[float]) -> tuple[float, float, float]:
    if not values:
        return float("nan"), float("nan"), float("nan")
    return statistics.fmean(values), percentile(values, 50), percentile(values, 99)


# ---- workload --------------------------------------------------------------------------------


def build_documents(tokenizer: Any, num_docs: int, doc_tokens: int, seed: int) -> list[str]:
    """`num_docs` documents of about `doc_tokens` tokens each, made of the tiny corpus' sentences
    (its vocabulary tokenizes compactly). Lines holding the separator are left out: a document must
    stay one chunk."""
    from tests.support.tiny_checkpoint import corpus

    sentences = [line.strip() for line in corpus(num_lines=4000, seed=seed) if SEPARATOR not in line]
    rng = random.Random(seed)
    docs: list[str] = []
    for i in range(num_docs):
        parts = [f"Document {i}."]
        while len(tokenizer.encode(" ".join(parts), add_special_tokens=False)) < doc_tokens:
            parts.append(rng.choice(sentences))
        docs.append(" ".join(parts))
    return docs


def build_prompts(docs: list[str], num_requests: int, docs_per_prompt: int, seed: int) -> list[str]:
    """Each prompt draws `docs_per_prompt` documents from the pool in a random order: documents
    recur across prompts, rarely with the same neighbours or at the same place."""
    from tests.support.tiny_checkpoint import corpus

    lines = corpus(num_lines=600, seed=seed + 1)
    questions = [line for line in lines if line.endswith("?") and SEPARATOR not in line]
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_requests):
        chosen = rng.sample(docs, docs_per_prompt)
        prompts.append(SEPARATOR.join([SYSTEM, *chosen, rng.choice(questions)]))
    return prompts


def default_model(cache_root: Path) -> Path:
    from tests.support.tiny_checkpoint import build_checkpoint

    # build_checkpoint caches by its arguments: a rerun reuses the directory.
    return build_checkpoint(cache_root / "bench-serve-small", arch="llama", **SMALL_OVERRIDES)


# ---- server process --------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m chunkcache.server.cli` on a free loopback port, its log in a temp file."""

    health_path = "/health"  # answers 200 once the server can take requests

    def __init__(self, model: Path, chunk_cache: bool, extra: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        flag = "--enable-chunk-cache" if chunk_cache else "--no-enable-chunk-cache"
        self.cmd = [
            sys.executable, "-m", "chunkcache.server.cli", "--model", str(model), "--port", str(self.port),
            "--max-queue", "100000", "--log-level", "warning", flag, *extra,
        ]  # fmt: skip
        self.log_path = log_dir / f"server-chunk-cache-{'on' if chunk_cache else 'off'}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300.0) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        # The environment must not flip the mode under test.
        env.pop("CHUNKCACHE_ENABLE_CHUNK_CACHE", None)
        env.pop("VLLM_ENABLE_CHUNK_CACHE", None)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}{self.health_path}", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"server did not come up in {timeout}s:\n{self.log_tail()}")
            time.sleep(0.25)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


# ---- client ----------------------------------------------------------------------------------


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> RequestResult:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,  # equal output lengths in both modes: the comparison is about prefill
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last: float | None = None
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
                    usage = event["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.output_tokens = usage["completion_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                if not event.get("choices") or not event["choices"][0].get("text"):
                    continue
                if last is None:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                last = now
        result.e2e = time.perf_counter() - start
        result.ok = last is not None
        if not result.ok:
            result.error = "no token received"
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_interleaved(
    urls: dict[str, str], prompts: list[str], max_tokens: int, concurrency: int, rounds: int
) -> tuple[dict[str, ModeResult], list[float]]:
    """Every mode's results over the same prompts, run in alternating rounds; and per round the
    TTFT mean ratio of the second mode over the first (off / on when both run)."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(600.0)
    clients = {m: httpx.AsyncClient(base_url=u, timeout=timeout, limits=limits) for m, u in urls.items()}
    modes = list(urls)
    results: dict[str, list[RequestResult]] = {m: [] for m in modes}
    durations = dict.fromkeys(modes, 0.0)
    round_ratios: list[float] = []
    try:
        for m in modes:
            # Warm-up on a prompt without separators: torch's first calls are slow, and the chunk
            # cache must start empty for both modes alike.
            await one_request(clients[m], "Where does Mirela live?", 2)
        semaphore = asyncio.Semaphore(concurrency)
        bar = tqdm(total=len(prompts) * len(modes), desc="rounds", unit="req")

        async def bounded(client: httpx.AsyncClient, prompt: str) -> RequestResult:
            async with semaphore:
                result = await one_request(client, prompt, max_tokens)
            bar.update(1)
            return result

        size = -(-len(prompts) // rounds)
        for k in range(0, len(prompts), size):
            part = prompts[k : k + size]
            means: dict[str, float] = {}
            for m in modes if (k // size) % 2 == 0 else modes[::-1]:
                start = time.perf_counter()
                got = await asyncio.gather(*(bounded(clients[m], p) for p in part))
                durations[m] += time.perf_counter() - start
                results[m].extend(got)
                ttfts = [r.ttft for r in got if r.ok]
                means[m] = statistics.fmean(ttfts) if ttfts else float("nan")
            if len(modes) == 2:
                round_ratios.append(means[modes[1]] / means[modes[0]])
        bar.close()
        stats = {m: (await clients[m].get("/v1/chunk_cache/stats")).json() for m in modes}
    finally:
        for c in clients.values():
            await c.aclose()
    named = {m: ModeResult(f"chunk cache {m}", results[m], durations[m], stats[m]) for m in modes}
    return named, round_ratios


# ---- report ----------------------------------------------------------------------------------


def report(mode: ModeResult) -> dict[str, float]:
    ok = mode.ok
    ttft = summarize([r.ttft for r in ok])
    tpot = summarize([t for r in ok if (t := r.tpot) is not None])
    itl = summarize([x for r in ok for x in r.itls])
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    figures = {
        "ttft_mean": ttft[0],
        "ttft_p50": ttft[1],
        "ttft_p99": ttft[2],
        "tpot_mean": tpot[0],
        "itl_mean": itl[0],
        "req_per_s": len(ok) / mode.duration,
        "out_tok_per_s": out_tokens / mode.duration,
        "cached_share": cached / prompt_tokens if prompt_tokens else 0.0,
    }
    print(f"\n=== {mode.name}: {len(ok)}/{len(mode.results)} requests ok in {mode.duration:.2f}s ===")
    for r in mode.results:
        if not r.ok:
            print(f"  failed: {r.error}")
            break
    print(f"  {'metric':<10}{'mean':>12}{'p50':>12}{'p99':>12}")
    for name, (mean, p50, p99) in (("TTFT ms", ttft), ("TPOT ms", tpot), ("ITL ms", itl)):
        print(f"  {name:<10}{mean * 1e3:>12.2f}{p50 * 1e3:>12.2f}{p99 * 1e3:>12.2f}")
    print(f"  throughput: {figures['req_per_s']:.2f} req/s, {figures['out_tok_per_s']:.1f} output tok/s")
    print(f"  prompt tokens: {prompt_tokens}, from cache: {cached} ({figures['cached_share']:.1%})")
    if mode.chunk_stats.get("enabled"):
        s = mode.chunk_stats
        print(f"  chunk cache: hits {s.get('hits')} misses {s.get('misses')} entries {s.get('entries')}")
    return figures


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    server_extra: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, server_extra = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="model dir (default: build a small random one)"
    )
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-docs", type=int, default=12, help="documents in the pool")
    parser.add_argument("--docs-per-prompt", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=160, help="approximate tokens per document")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--modes", default="on,off", help="chunk cache modes to run: on,off")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (slices of the requests)")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("on", "off") for m in modes):
        parser.error(f"--modes must list 'on' and/or 'off', got {args.modes!r}")
    if args.docs_per_prompt > args.num_docs:
        parser.error("--docs-per-prompt cannot exceed --num-docs")

    sys.path.insert(0, str(REPO))  # chunkcache, and tests.support.tiny_checkpoint (the random checkpoints)
    from transformers import AutoTokenizer

    work = Path(tempfile.gettempdir()) / "chunkcache-bench"
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or default_model(work)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    docs = build_documents(tokenizer, args.num_docs, args.doc_tokens, args.seed)
    prompts = build_prompts(docs, args.num_requests, args.docs_per_prompt, args.seed)
    mean_len = statistics.fmean(len(tokenizer.encode(p)) for p in prompts)
    print(
        f"model {model}\nworkload: {args.num_requests} requests, concurrency {args.concurrency}, "
        f"{args.num_docs} docs x ~{args.doc_tokens} tokens, {args.docs_per_prompt} per prompt "
        f"(~{mean_len:.0f} prompt tokens), {args.max_tokens} output tokens; server args {server_extra}\n"
        f"machine: {os.cpu_count()} cpus, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )

    servers = {
        m: ServerProcess(model, chunk_cache=m == "on", extra=server_extra, log_dir=work) for m in modes
    }
    try:
        for server in servers.values():
            server.start()
        results, round_ratios = asyncio.run(
            run_interleaved(
                {m: s.url for m, s in servers.items()},
                prompts,
                args.max_tokens,
                args.concurrency,
                args.rounds,
            )
        )
    finally:
        for server in servers.values():
            server.stop()
    figures: dict[str, dict[str, float]] = {}
    for mode, result in results.items():
        figures[mode] = report(result)
        if len(result.ok) != len(result.results):
            print(f"server log tail:\n{servers[mode].log_tail()}")
            return 1
    if round_ratios:
        print(
            f"\nTTFT mean ratio {modes[1]} / {modes[0]} per round: "
            + ", ".join(f"{r:.2f}x" for r in round_ratios)
        )

    # key=value pairs, ratios first: the comparison is what survives a noisy machine.
    parts: list[str] = []
    if "on" in figures and "off" in figures:
        on, off = figures["on"], figures["off"]
        parts.append(f"ttft_mean_ratio_off_on={off['ttft_mean'] / on['ttft_mean']:.2f}x")
        parts.append(f"ttft_p50_ratio_off_on={off['ttft_p50'] / on['ttft_p50']:.2f}x")
        parts.append(f"throughput_ratio_on_off={on['out_tok_per_s'] / off['out_tok_per_s']:.2f}x")
        per_round = [r if modes[0] == "on" else 1 / r for r in round_ratios]
        parts.append(
            f"ttft_ratio_rounds_min={min(per_round):.2f}x ttft_ratio_rounds_max={max(per_round):.2f}x"
        )
    for mode, f in figures.items():
        parts.append(f"ttft_mean_{mode}={f['ttft_mean'] * 1e3:.1f}ms")
        parts.append(f"tpot_mean_{mode}={f['tpot_mean'] * 1e3:.1f}ms")
        parts.append(f"out_tok_s_{mode}={f['out_tok_per_s']:.1f}")
        parts.append(f"cached_{mode}={f['cached_share']:.1%}")
    parts += [f"concurrency={args.concurrency}", f"requests={args.num_requests}", f"rounds={args.rounds}"]
    print("SUMMARY bench_serve: " + " ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
