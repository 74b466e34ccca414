"""Router cluster benchmark: 3 `chunkcache serve` replicas behind `chunkcache route`, every routing
policy on RAG workloads whose documents recur in other combinations and orders.

Every policy (random, round_robin, least_loaded, prefix_only, cache_aware; or a policy with
router options of its own, `cache_aware:--cache-threshold=0`) gets a fresh cluster on loopback
(empty caches, empty index), all of them up at once: the router binds one KV event socket, each
replica's publisher connects to it with its own topic `kv@<replica>@<model>` and serves its own
replay endpoint. The request list is cut into `--rounds` (6) slices; each slice goes through every
policy's router in turn (streaming completions at a fixed concurrency; the other clusters idle
meanwhile), the order rotated per round. So every policy serves the same requests in the same
order, and a drift of the machine's load (other jobs on a shared machine moved one policy's mean
TTFT 1.6x between back-to-back runs) falls on all of them alike. Reported: TTFT (time to the
first streamed token) mean / p50 / p90, the chunk-cache hit rate summed over the replicas'
`/v1/chunk_cache/stats`, the prompt tokens served from cache (usage `cached_tokens`), and how the
router spread the requests; ratios of mean TTFT, with the range of the per-round ratios beside
them. `--repeats` runs it all again on fresh clusters.

The workload shapes (`--shapes`): documents of 100-200 tokens; a number of retrieval results
("topics"), each a random combination of documents (topics overlap: a document belongs to
several); every request takes a topic's documents in a fresh random order with another question,
`SYS # # D.. # # Q`. "recurring": 40 documents, 12 topics of 3-5, so each result recurs about ten
times in 120 requests; "spread": 60 documents, 24 topics of 2-4, half as many recurrences;
"conversations": as "recurring", but each topic's documents always in the same order (follow-up
turns, which read an earlier request's blended KV on the replica that served it). A
replica's chunk cache holds `--cache-fraction` (40%) of the documents' tokens: the three caches
together hold the working set, one alone does not, which is the regime where placement decides the
hit rate (with caches that hold everything, cache-blind policies only lose the first sight of each
document on each replica).

What a prefix-only router sees: the replicas use layout "offset", which registers a request's
system part and first document in the prefix cache (their KV is a plain prefill's) and publishes
them as BlockStored; the router keys a chunked prompt's whole token list into blocks. So
prefix_only finds the replica that last served the same first document, and falls back to
least-loaded only when none did (the fallbacks are reported). Document order defeats it
otherwise; only the chunk score knows where every document is. "new" beside the fallbacks: the
prompts no replica held the router's `--cache-threshold` of, sent to the least loaded replica.

Summary line (ratios: the other policy's mean TTFT over cache_aware's, higher is better; each
target marked met or MISSED):
    SUMMARY bench_router_cluster: recurring:cache_aware_vs_round_robin=X.XXx(rounds A-B)[target>=2: met] ...

Usage:
    python benchmarks/bench_router_cluster.py                 # ~30 minutes on 2 busy cores (three shapes)
    python benchmarks/bench_router_cluster.py --quick         # smoke run: 3 policies, 30 requests
    python benchmarks/bench_router_cluster.py --policies round_robin,prefix_only,cache_aware --shapes recurring
    python benchmarks/bench_router_cluster.py --server-arg=--chunk-layout=isolated   # replica options
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
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
from serve_metrics import percentile
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
POLICIES = ("random", "round_robin", "least_loaded", "prefix_only", "cache_aware")
SEPARATOR = " # # "
MODEL_NAME = "bench-small"
SYSTEM = (
    "You are a helpful assistant. Answer the question using only the documents below, and say "
    "which document each fact comes from."
)
# bench_serve's small model: the tiny recipe widened and deepened until a prefill of a thousand
# tokens costs clearly more than a question-only one. Random weights.
SMALL_OVERRIDES: dict[str, Any] = {
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 768,
    "max_position_embeddings": 4096,
}
WARMUP = "Where does the river begin, and who keeps the old mill by the bridge running at night?"
PAGE = 16  # the engine's block (= chunk pool page) size


# ---- workload ----------------------------------------------------------------------------------


def build_documents(tokenizer: Any, num_docs: int, lo: int, hi: int, seed: int) -> list[str]:
    """`num_docs` documents of lo..hi tokens each, from the tiny corpus' sentences (no separator)."""
    from tests.support.tiny_checkpoint import corpus

    sentences = [s.strip() for s in corpus(num_lines=4000, seed=seed) if "#" not in s]
    rng = random.Random(seed)
    docs = []
    for i in range(num_docs):
        target = rng.randint(lo, hi)
        parts = [f"Document {i}."]
        while len(tokenizer.encode(" ".join(parts), add_special_tokens=False)) < target:
            parts.append(rng.choice(sentences))
        docs.append(" ".join(parts))
    return docs


def build_prompts(
    docs: list[str],
    num_requests: int,
    topics: int,
    min_docs: int,
    max_docs: int,
    seed: int,
    shuffle: bool = True,
) -> list[str]:
    from tests.support.tiny_checkpoint import corpus

    rng = random.Random(seed + 1)
    questions = [q for q in corpus(num_lines=1200, seed=seed + 2) if q.endswith("?") and "#" not in q]
    groups = [rng.sample(docs, rng.randint(min_docs, max_docs)) for _ in range(topics)]
    prompts = []
    for _ in range(num_requests):
        chosen = list(rng.choice(groups)) if groups else rng.sample(docs, rng.randint(min_docs, max_docs))
        if shuffle:
            rng.shuffle(chosen)
        prompts.append(SEPARATOR.join([SYSTEM, *chosen, rng.choice(questions)]))
    return prompts


def kv_bytes_per_token(model: Path) -> int:
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[cfg.get("torch_dtype") or "float32"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes


# ---- processes ---------------------------------------------------------------------------------


_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A free loopback port, never one this run handed out before: with every policy's cluster up
    at once, the OS could give a port back that a process not yet started was told to use."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


class Proc:
    """A child process with its log in a file."""

    def __init__(self, name: str, cmd: list[str], url: str, log_dir: Path) -> None:
        self.name, self.cmd, self.url = name, cmd, url
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        for key in list(env):  # engine options from the environment must not change the setup
            if key.startswith(("CHUNKCACHE_", "VLLM_")):
                del env[key]
        # One torch thread per replica: three replicas share the machine's cores.
        env.update(TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.cmd, env=env, stdout=log, stderr=subprocess.STDOUT)

    def healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


@dataclass
class Cluster:
    router: Proc
    replicas: list[Proc]

    @property
    def procs(self) -> list[Proc]:
        return [self.router, *self.replicas]

    def wait_healthy(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        pending = list(self.procs)
        while pending:
            pending = [p for p in pending if not p.healthy()]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{[p.name for p in pending]} did not come up in {timeout}s")
            time.sleep(0.25)

    def stop(self) -> None:
        """SIGTERM to all at once (they shut down in parallel), then SIGKILL what is left."""
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait()


@dataclass(frozen=True)
class Variant:
    """A routing policy, with router options of its own: `cache_aware:--cache-threshold=0`."""

    label: str
    policy: str
    router_args: tuple[str, ...] = ()

    @classmethod
    def parse(cls, spec: str) -> Variant:
        policy, *extra = spec.split(":")
        return cls(spec, policy, tuple(extra))

    @property
    def file_name(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.label)


def make_cluster(model: Path, variant: Variant, args: argparse.Namespace, log_dir: Path) -> Cluster:
    policy, name_prefix = variant.policy, variant.file_name
    events = f"tcp://127.0.0.1:{free_port()}"
    replicas, specs = [], []
    for i in range(args.replicas):
        name = f"r{i}"
        port, replay = free_port(), f"tcp://127.0.0.1:{free_port()}"
        cmd = [
            sys.executable, "-m", "chunkcache.server.cli", "--model", str(model),
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--max-queue", "100000",
            "--served-model-name", MODEL_NAME, "--device", "cpu",
            "--kv-cache-tokens", str(args.kv_cache_tokens),
            "--chunk-cache-size-gb", f"{args.chunk_cache_gb:.6f}",
            # A concrete host:port connects: to the router's bound SUB socket.
            "--kv-events-endpoint", events, "--kv-events-topic", f"kv@{name}@{MODEL_NAME}",
            "--kv-events-replay-endpoint", replay,
            *args.server_arg,
        ]  # fmt: skip
        replicas.append(Proc(f"{name_prefix}-{name}", cmd, f"http://127.0.0.1:{port}", log_dir))
        specs.append(f"{name}@http://127.0.0.1:{port}=={replay}")  # no PUB to connect to; a replay
    port = free_port()
    cmd = [
        sys.executable, "-m", "chunkcache.router", "--backends", ",".join(specs),
        "--tokenizer", str(model), "--model-name", MODEL_NAME, "--policy", policy, "--seed", str(args.seed),
        "--events-bind", events, "--events-topic-filter", "kv@", "--event-workers", "2",
        "--health-interval", "2", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    if args.load_weight is not None:
        cmd += ["--load-weight", str(args.load_weight)]
    cmd += [*args.router_arg, *variant.router_args]
    return Cluster(Proc(f"{name_prefix}-router", cmd, f"http://127.0.0.1:{port}", log_dir), replicas)


# ---- client ------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    backend: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""


@dataclass
class PolicyResult:
    policy: str
    results: list[RequestResult]
    duration: float
    chunk_stats: list[dict[str, Any]]
    decisions: dict[str, float] = field(default_factory=dict)
    fallbacks: float = 0.0  # routed by load because the index knew nothing of the prompt
    new_prompts: float = 0.0  # routed by load because no replica held --cache-threshold of it
    loadavg: float = 0.0
    round_ttft: list[float] = field(default_factory=list)  # mean TTFT of each interleaved round

    @property
    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> RequestResult:
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    result = RequestResult()
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            result.backend = r.headers.get("x-chunkcache-backend", "")
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("choices") and not result.ttft:
                    # The server streams a chunk only once it has text: the first token's arrival.
                    result.ttft = time.perf_counter() - start
                if event.get("usage"):
                    usage = event["usage"]
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        result.ok = result.ttft > 0
        if not result.ok:
            result.error = "no token received"
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def router_metrics(text: str) -> tuple[dict[str, float], dict[str, float]]:
    """(routing decisions per backend, fallbacks per reason) from the router's /metrics."""
    decisions: dict[str, float] = {}
    fallbacks: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("chunkcache_router_routing_decisions_total{"):
            labels, value = line.rsplit(" ", 1)
            backend = labels.split('backend="', 1)[1].split('"', 1)[0]
            decisions[backend] = decisions.get(backend, 0.0) + float(value)
        elif line.startswith("chunkcache_router_fallbacks_total{"):
            labels, value = line.rsplit(" ", 1)
            reason = labels.split('reason="', 1)[1].split('"', 1)[0] if 'reason="' in labels else ""
            fallbacks[reason] = fallbacks.get(reason, 0.0) + float(value)
    return decisions, fallbacks


async def run_interleaved(
    clusters: dict[str, Cluster], prompts: list[str], args: argparse.Namespace, rotation: int
) -> dict[str, PolicyResult]:
    """The prompts, cut into `args.rounds` slices in order, through every cluster: each slice goes
    to one cluster after the other (the order rotated per round), the others idle meanwhile. So
    every cluster sees every prompt, in the same order, and a drift of the machine's load over the
    run falls on all of them alike."""
    timeout = httpx.Timeout(600.0)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    labels = list(clusters)
    clients = {
        k: httpx.AsyncClient(base_url=c.router.url, timeout=timeout, limits=limits)
        for k, c in clusters.items()
    }
    try:
        # Warm every replica directly (torch's first calls are slow) on a prompt without chunks,
        # sharing nothing with the workload: chunk caches and the index start empty of it.
        async with httpx.AsyncClient(timeout=timeout) as direct:
            await asyncio.gather(
                *(
                    direct.post(
                        f"{r.url}/v1/completions",
                        json={"model": MODEL_NAME, "prompt": WARMUP, "max_tokens": 2, "temperature": 0},
                    )
                    for c in clusters.values()
                    for r in c.replicas
                )
            )
        before = {k: router_metrics((await clients[k].get("/metrics")).text)[1] for k in labels}
        results: dict[str, list[RequestResult]] = {k: [] for k in labels}
        round_ttft: dict[str, list[float]] = {k: [] for k in labels}
        durations = dict.fromkeys(labels, 0.0)
        loads: dict[str, list[float]] = {k: [] for k in labels}
        rounds = max(1, min(args.rounds, len(prompts)))
        cuts = [round(i * len(prompts) / rounds) for i in range(rounds + 1)]
        bar = tqdm(total=len(prompts) * len(labels), desc="requests", unit="req", leave=False)
        for r in range(rounds):
            part = prompts[cuts[r] : cuts[r + 1]]
            k0 = (rotation + r) % len(labels)
            for label in labels[k0:] + labels[:k0]:
                semaphore = asyncio.Semaphore(args.concurrency)
                client = clients[label]

                async def bounded(prompt: str, client: httpx.AsyncClient = client) -> RequestResult:
                    async with semaphore:  # noqa: B023 - awaited within this iteration
                        result = await one_request(client, prompt, args.max_tokens)
                    bar.update(1)
                    return result

                start = time.perf_counter()
                done = await asyncio.gather(*(bounded(p) for p in part))
                durations[label] += time.perf_counter() - start
                results[label] += done
                ok = [x.ttft for x in done if x.ok]
                round_ttft[label].append(statistics.fmean(ok) if ok else float("nan"))
                loads[label].append(os.getloadavg()[0])
        bar.close()
        out: dict[str, PolicyResult] = {}
        for label, cluster in clusters.items():
            decisions, fallbacks = router_metrics((await clients[label].get("/metrics")).text)
            stats = [
                (await clients[label].get(f"{r.url}/v1/chunk_cache/stats")).json() for r in cluster.replicas
            ]
            new = {k: v - before[label].get(k, 0.0) for k, v in fallbacks.items()}
            below = new.pop("below_cache_threshold", 0.0)
            out[label] = PolicyResult(
                label,
                results[label],
                durations[label],
                stats,
                decisions,
                sum(new.values()),
                below,
                statistics.fmean(loads[label]),
                round_ttft[label],
            )
        return out
    finally:
        for client in clients.values():
            await client.aclose()


# ---- report ------------------------------------------------------------------------------------


def figures(res: PolicyResult) -> dict[str, float]:
    ttft = [r.ttft for r in res.ok]
    hits = sum(s.get("hits", 0) for s in res.chunk_stats)
    misses = sum(s.get("misses", 0) for s in res.chunk_stats)
    hit_tok = sum(s.get("hit_tokens", 0) for s in res.chunk_stats)
    miss_tok = sum(s.get("miss_tokens", 0) for s in res.chunk_stats)
    prompt = sum(r.prompt_tokens for r in res.ok)
    return {
        "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p50": percentile(ttft, 50),
        "ttft_p90": percentile(ttft, 90),
        "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "token_hit_rate": hit_tok / (hit_tok + miss_tok) if hit_tok + miss_tok else 0.0,
        "cached_share": sum(r.cached_tokens for r in res.ok) / prompt if prompt else 0.0,
        "evictions": sum(s.get("evictions", 0) for s in res.chunk_stats),
        "req_per_s": len(res.ok) / res.duration,
    }


def print_table(results: list[PolicyResult], figs: list[dict[str, float]]) -> None:
    width = max(13, *(len(r.policy) + 1 for r in results))
    head = (
        f"{'policy':<{width}}{'ok':>7}{'TTFT mean':>11}{'p50':>9}{'p90':>9}{'chunk hits':>12}"
        f"{'hit tokens':>12}{'cached':>9}{'evicted':>9}{'req/s':>7}  {'spread (fallbacks/new)':<24}{'load':>6}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for res, f in zip(results, figs, strict=True):
        spread = "/".join(f"{res.decisions.get(f'r{i}', 0):.0f}" for i in range(len(res.chunk_stats)))
        if res.decisions == {} and res.ok:
            spread = "/".join(
                str(sum(r.backend == f"r{i}" for r in res.ok)) for i in range(len(res.chunk_stats))
            )
        print(
            f"{res.policy:<{width}}{len(res.ok):>3}/{len(res.results):<3}{f['ttft_mean'] * 1e3:>9.1f}ms"
            f"{f['ttft_p50'] * 1e3:>7.1f}ms{f['ttft_p90'] * 1e3:>7.1f}ms{f['hit_rate']:>12.1%}"
            f"{f['token_hit_rate']:>12.1%}{f['cached_share']:>9.1%}{f['evictions']:>9.0f}"
            f"{f['req_per_s']:>7.2f}  {spread + f' ({res.fallbacks:.0f}/{res.new_prompts:.0f})':<24}{res.loadavg:>6.2f}"
        )


# Workload shapes: (documents, topics, documents per prompt, shuffled). The lead of a cache-aware
# router depends on the shape (how often a retrieval result recurs), so it is measured on several.
SHAPES: dict[str, tuple[int, int, tuple[int, int], bool]] = {
    "recurring": (40, 12, (3, 5), True),  # 12 retrieval results, each about ten times in 120 requests
    "spread": (60, 24, (2, 4), True),  # twice the results, fewer documents each: fewer recurrences
    # RAG chat: each topic's documents always in its own order, another question each time (the
    # follow-up turns of 12 conversations): a replica that served a topic holds its blended KV.
    "conversations": (40, 12, (3, 5), False),
}


def run_shape(
    shape: str, model: Path, tok: Any, variants: list[Variant], args: argparse.Namespace, log_dir: Path
) -> dict[str, list[PolicyResult]] | None:
    """Every variant `args.repeats` times on one workload shape, interleaved in `args.rounds`
    rounds (run_interleaved), the order rotated per round and repeat so that a drift of the
    machine's load favours none. None after a failed request."""
    num_docs, topics, per_prompt, shuffle = SHAPES[shape]
    docs = build_documents(tok, num_docs, *args.doc_tokens, args.seed)
    prompts = build_prompts(docs, args.num_requests, topics, *per_prompt, args.seed, shuffle)
    doc_pages = sum(-(-len(tok.encode(d, add_special_tokens=False)) // PAGE) for d in docs)
    sys_pages = -(-len(tok.encode(SYSTEM)) // PAGE)
    pool_pages = round(args.cache_fraction * doc_pages) + sys_pages
    args.chunk_cache_gb = pool_pages * PAGE * kv_bytes_per_token(model) / 2**30
    mean_len = statistics.fmean(len(tok.encode(x)) for x in prompts)
    print(
        f"\n=== shape {shape!r}: {args.num_requests} requests at concurrency {args.concurrency}; "
        f"{num_docs} docs of {args.doc_tokens[0]}-{args.doc_tokens[1]} tokens ({doc_pages * PAGE} tokens in "
        f"pages), {per_prompt[0]}-{per_prompt[1]} per prompt from {topics or 'no'} topics, ~{mean_len:.0f} "
        f"prompt tokens, {args.max_tokens} output tokens; {args.replicas} replicas, chunk cache {pool_pages} "
        f"pages ({args.cache_fraction:.0%} of the documents, {args.chunk_cache_gb * 1024:.1f} MiB) each; "
        f"{args.repeats} repeats of {args.rounds} interleaved rounds, policy order rotated"
    )
    results: dict[str, list[PolicyResult]] = {v.label: [] for v in variants}
    bar = tqdm(total=args.repeats, desc=shape, unit="repeat")
    for rep in range(args.repeats):
        # Every variant's cluster is up at once (fresh: empty caches and index); see run_interleaved.
        clusters = {v.label: make_cluster(model, v, args, log_dir) for v in variants}
        try:
            for cluster in clusters.values():
                for proc in cluster.procs:
                    proc.start()
            for cluster in clusters.values():
                cluster.wait_healthy()
            round_results = asyncio.run(run_interleaved(clusters, prompts, args, rotation=rep))
        finally:
            for cluster in clusters.values():
                for proc in cluster.procs:
                    proc.terminate()
            for cluster in clusters.values():
                cluster.stop()  # SIGKILL what SIGTERM left
        bar.update()
        for label, res in round_results.items():
            results[label].append(res)
            if len(res.ok) != len(res.results):
                err = next(r.error for r in res.results if not r.ok)
                print(f"{label}: {len(res.results) - len(res.ok)} requests failed, e.g. {err}")
                for proc in clusters[label].procs:
                    print(f"--- {proc.name} log tail:\n{proc.log_tail()}")
                return None
    bar.close()
    return results


def shape_summary(shape: str, results: dict[str, list[PolicyResult]]) -> list[str]:
    """The shape's table (every run) and its SUMMARY parts: ratios of mean TTFT (mean over the
    repeats of each run's mean), with the range of the per-repeat ratios."""
    runs = [r for rs in results.values() for r in rs]
    print_table(runs, [figures(r) for r in runs])
    parts: list[str] = []
    targets = {"round_robin": 2.0, "prefix_only": 1.0}
    others = ("round_robin", "prefix_only", "random", "least_loaded")
    for mine in (k for k in results if k.split(":")[0] == "cache_aware"):
        ca = results[mine]
        name = mine.replace(":", "[", 1) + "]" if ":" in mine else mine
        for other in (*others, *(k for k in results if k.split(":")[0] == "cache_aware" and k != mine)):
            if other not in results:
                continue
            theirs = results[other]
            ratio = statistics.fmean(figures(r)["ttft_mean"] for r in theirs) / statistics.fmean(
                figures(r)["ttft_mean"] for r in ca
            )
            # Per interleaved round (and repeat): the same prompts, at the same time of the run.
            each = [
                t / c
                for a, b in zip(theirs, ca, strict=True)
                for t, c in zip(a.round_ttft, b.round_ttft, strict=True)
            ]
            other_name = other.replace(":", "[", 1) + "]" if ":" in other else other
            part = f"{shape}:{name}_vs_{other_name}={ratio:.2f}x(rounds {min(each):.2f}-{max(each):.2f})"
            if other in targets and mine == "cache_aware":
                op = ">=" if other == "round_robin" else ">"
                ok = ratio >= targets[other] if other == "round_robin" else ratio > targets[other]
                part += f"[target{op}{targets[other]:g}: {'met' if ok else 'MISSED'}]"
            parts.append(part)
    if "prefix_only" in results:
        po = results["prefix_only"]
        fallbacks = sum(r.fallbacks for r in po) / len(po)
        parts.append(f"{shape}:prefix_only_fallbacks={fallbacks:.0f}/{len(po[0].results)}")
    for label, rs in results.items():
        name = label.replace(":", "[", 1) + "]" if ":" in label else label
        parts.append(
            f"{shape}:ttft_mean_{name}={statistics.fmean(figures(r)['ttft_mean'] for r in rs) * 1e3:.1f}ms"
        )
        parts.append(f"{shape}:hit_rate_{name}={statistics.fmean(figures(r)['hit_rate'] for r in rs):.1%}")
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="model dir (default: build the small random one)")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated; a policy with router options of its own is POLICY:ARG[:ARG...] "
        "(cache_aware:--cache-threshold=0)",
    )
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"workload shapes, of {list(SHAPES)}")
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="fresh clusters per shape, each running every policy (default: 1)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=6,
        help="slices of the requests, each run through every policy's cluster in turn, the order rotated "
        "(default: %(default)s)",
    )
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=120)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, nargs=2, default=(100, 200), metavar=("MIN", "MAX"))
    p.add_argument(
        "--cache-fraction",
        type=float,
        default=0.4,
        help="share of the documents' tokens one replica's chunk cache holds (default: %(default)s)",
    )
    p.add_argument(
        "--load-weight", type=float, default=None, help="the router's --load-weight (default: its own)"
    )
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an option for every replica's `chunkcache serve`, repeatable; write it with '=' "
        "(--server-arg=--chunk-layout=isolated)",
    )
    p.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an option for the router, repeatable (--router-arg=--load-weight=1.0)",
    )
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 3 policies, 30 requests, 1 repeat, 3 rounds"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.repeats, args.rounds = 30, 1, 3
        if args.policies == ",".join(POLICIES):
            args.policies = "round_robin,prefix_only,cache_aware"
    variants = [Variant.parse(x.strip()) for x in args.policies.split(",") if x.strip()]
    unknown = [v.policy for v in variants if v.policy not in POLICIES]
    if unknown or not variants:
        p.error(f"unknown policies {unknown}; choose from {POLICIES}")
    if len({v.label for v in variants}) != len(variants):
        p.error("a policy is named twice")
    shapes = [x.strip() for x in args.shapes.split(",") if x.strip()]
    if not shapes or any(x not in SHAPES for x in shapes):
        p.error(f"--shapes must name some of {list(SHAPES)}, got {args.shapes!r}")
    if args.repeats < 1 or args.rounds < 1:
        p.error("--repeats and --rounds must be >= 1")

    sys.path.insert(0, str(REPO))  # chunkcache, and tests.support.tiny_checkpoint (the random checkpoints)
    from transformers import AutoTokenizer

    from tests.support.tiny_checkpoint import build_checkpoint

    work = Path(tempfile.gettempdir()) / "chunkcache-bench"
    work.mkdir(parents=True, exist_ok=True)
    model = args.model or build_checkpoint(work / "bench-serve-small", arch="llama", **SMALL_OVERRIDES)
    tok = AutoTokenizer.from_pretrained(str(model))
    log_dir = Path(tempfile.mkdtemp(prefix="bench-router-cluster-"))
    print(
        f"model {model} ({kv_bytes_per_token(model)} KV bytes/token); logs in {log_dir}\n"
        f"replica options: {' '.join(args.server_arg) or '(defaults)'}; router options: "
        f"{' '.join(args.router_arg) or '(defaults)'}\n"
        f"machine: {os.cpu_count()} cpus, load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    parts: list[str] = []
    for shape in shapes:
        results = run_shape(shape, model, tok, variants, args, log_dir)
        if results is None:
            return 1
        parts += shape_summary(shape, results)
    parts += [
        f"requests={args.num_requests}",
        f"concurrency={args.concurrency}",
        f"repeats={args.repeats}",
        f"rounds={args.rounds}",
        f"loadavg={os.getloadavg()[0]:.2f}",
    ]
    print("SUMMARY bench_router_cluster: " + " ".join(parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
