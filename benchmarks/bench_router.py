"""Router benchmark: scoring latency over a large index, and KV event intake throughput.

1. Intake: BlockStored batches as 16 engines emit them (one request's chunked-prefill step of 128
   blocks per batch) are decoded, mapped to router keys and applied to a `MemoryIndex` through the
   same per-pod worker path the ZMQ intake uses, on one thread, until `--blocks` (1M) block
   entries are indexed. Reported: blocks/s (target >= 200k/s), by wall time and per CPU-second of
   the intake thread (on a shared machine the CPU figure is the one neighbours do not move).
2. Scoring: 8k-token prompts against that index over 16 pods: router block keys + index lookup +
   longest-prefix scoring (target p99 <= 2 ms; wall and CPU time), with tokenization timed apart (an 8k-token text
   through the tokenizer's `encode`). Queries mix prompts one pod holds whole, prompts sharing a
   group's system prefix (held by up to `--pods-per-key` pods), and unseen prompts; then the worst
   case apart: one prompt held whole by `--pods-per-key` pods.

The workload: prompts of `--prompt-tokens` tokens in 8 groups; a group's prompts share a
1024-token system prefix; each prompt is stored by one pod (the first prompt of a group on a pod
stores the prefix, later ones only their suffix, as an engine's prefix cache does).

Not here: the 3-replica cluster comparison of routing policies, which needs `chunkcache serve`:
`benchmarks/bench_router_cluster.py`.

Usage:
    python benchmarks/bench_router.py
    python benchmarks/bench_router.py --blocks 200000 --queries 100   # quicker
    python benchmarks/bench_router.py --tokenizer DIR                  # a real model's tokenizer
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import string
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

# The repo root (chunkcache) and tests/ (tiny_checkpoint: the random tokenizer).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chunkcache.kv_events import BlockStored, KVEventBatch, encode_batch
from chunkcache.router.events import EventIntake
from chunkcache.router.index import MemoryIndex
from chunkcache.router.scorer import Scorer
from chunkcache.router.tokens import BlockKeyer, PromptProcessor

BLOCK = 16
GROUPS = 8
PREFIX_BLOCKS = 64  # a 1024-token system prefix shared by a group
BLOCKS_PER_EVENT = 128  # one chunked-prefill step of 2048 tokens
VOCAB = 150_000


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


class Workload:
    """Token ids and engine hashes of every prompt; engine hashes are random (the router never
    recomputes them) but content-consistent: a group's prefix has one set of hashes."""

    def __init__(self, num_prompts: int, prompt_blocks: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.prompt_blocks = prompt_blocks
        self.tokens = rng.integers(10, VOCAB, size=(num_prompts, prompt_blocks * BLOCK), dtype=np.uint32)
        self.hashes = rng.integers(1, 2**63, size=(num_prompts, prompt_blocks), dtype=np.uint64)
        prefix_tokens = rng.integers(10, VOCAB, size=(GROUPS, PREFIX_BLOCKS * BLOCK), dtype=np.uint32)
        prefix_hashes = rng.integers(1, 2**63, size=(GROUPS, PREFIX_BLOCKS), dtype=np.uint64)
        for i in range(num_prompts):
            self.tokens[i, : PREFIX_BLOCKS * BLOCK] = prefix_tokens[i % GROUPS]
            self.hashes[i, :PREFIX_BLOCKS] = prefix_hashes[i % GROUPS]

    def group(self, i: int) -> int:
        return i % GROUPS


def build_payloads(w: Workload, num_pods: int, seed: int) -> tuple[list[tuple[str, int, bytes]], int]:
    """(pod, seq, payload) per batch, in publish order, and the number of blocks they store."""
    rng = random.Random(seed)
    seqs = [0] * num_pods
    has_prefix: set[tuple[int, int]] = set()
    out: list[tuple[str, int, bytes]] = []
    blocks = 0
    for i in tqdm(range(len(w.tokens)), desc="encoding events", unit="prompt"):
        pod = rng.randrange(num_pods)
        start = PREFIX_BLOCKS if (pod, w.group(i)) in has_prefix else 0
        has_prefix.add((pod, w.group(i)))
        for b in range(start, w.prompt_blocks, BLOCKS_PER_EVENT):
            e = min(b + BLOCKS_PER_EVENT, w.prompt_blocks)
            ev = BlockStored(
                block_hashes=w.hashes[i, b:e].tolist(),
                parent_block_hash=int(w.hashes[i, b - 1]) if b else None,
                token_ids=w.tokens[i, b * BLOCK : e * BLOCK].tolist(),
                block_size=BLOCK,
            )
            out.append((f"pod-{pod}", seqs[pod], encode_batch(KVEventBatch(time.time(), [ev]))))
            seqs[pod] += 1
            blocks += e - b
    return out, blocks


def bench_intake(
    payloads: list[tuple[str, int, bytes]], blocks: int, pods_per_key: int
) -> tuple[EventIntake, float, float]:
    """The filled index, and blocks/s by wall time and by this thread's CPU time."""
    index = MemoryIndex(capacity=blocks + 1, pods_per_key=pods_per_key)
    intake = EventIntake(index, num_workers=1)  # not started: the worker path is called directly
    worker = intake.worker_for("pod-0")
    start, start_cpu = time.perf_counter(), time.thread_time()
    for pod, seq, payload in tqdm(payloads, desc="intake", unit="batch", mininterval=1.0):
        intake.process(worker, pod, seq, payload)
    elapsed, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
    st = intake.stats()
    assert st.failed == 0 and st.unresolved_blocks == 0, st
    return intake, blocks / elapsed, blocks / cpu


def query_prompts(w: Workload, queries: int, seed: int) -> list[list[int]]:
    """A third held whole by some pod, a third sharing only a group prefix, a third unseen."""
    rng = np.random.default_rng(seed + 1)
    prompts: list[list[int]] = []
    for q in range(queries):
        kind = q % 3
        if kind == 0:
            prompts.append(w.tokens[rng.integers(len(w.tokens))].tolist())
        elif kind == 1:
            t = w.tokens[rng.integers(len(w.tokens))].copy()
            t[PREFIX_BLOCKS * BLOCK :] = rng.integers(10, VOCAB, size=len(t) - PREFIX_BLOCKS * BLOCK)
            prompts.append(t.tolist())
        else:
            prompts.append(rng.integers(10, VOCAB, size=w.prompt_blocks * BLOCK).tolist())
    return prompts


def bench_scoring(
    w: Workload, index: MemoryIndex, num_pods: int, queries: int, seed: int
) -> dict[str, float]:
    keyer = BlockKeyer(BLOCK)
    scorer = Scorer(index)
    pods = [f"pod-{p}" for p in range(num_pods)]
    wall, cpu, keys_s, lookup_s = [], [], [], []
    hits = 0
    full_gcs = [0]

    def count_gc(phase: str, info: dict[str, int]) -> None:
        full_gcs[0] += phase == "start" and info["generation"] == 2

    gc.callbacks.append(count_gc)
    for tokens in tqdm(query_prompts(w, queries, seed), desc="scoring", unit="prompt"):
        c0, t0 = time.thread_time(), time.perf_counter()
        keys = keyer.request_keys(tokens)
        t1 = time.perf_counter()
        scores = scorer.score(keys, (), pods)
        t2 = time.perf_counter()
        cpu.append(time.thread_time() - c0)
        wall.append(t2 - t0)
        keys_s.append(t1 - t0)
        lookup_s.append(t2 - t1)
        hits += any(s.prefix_blocks for s in scores.values())
    gc.callbacks.remove(count_gc)
    ms = 1000.0
    return {
        "p50": pct(wall, 50) * ms,
        "p99": pct(wall, 99) * ms,
        "cpu_p50": pct(cpu, 50) * ms,
        "cpu_p99": pct(cpu, 99) * ms,
        "keys_p50": pct(keys_s, 50) * ms,
        "lookup_p50": pct(lookup_s, 50) * ms,
        "lookup_p99": pct(lookup_s, 99) * ms,
        "hit_queries": hits / queries,
        "full_gcs": full_gcs[0],
    }


def bench_hot_prompt(index: MemoryIndex, num_pods: int, prompt_tokens: int, runs: int) -> dict[str, float]:
    """The worst case: one prompt held whole by as many pods as a key may list."""
    keyer, scorer = BlockKeyer(BLOCK), Scorer(index)
    tokens = np.random.default_rng(99).integers(10, VOCAB, size=prompt_tokens).tolist()
    keys = keyer.request_keys(tokens)
    pods = [f"pod-{p}" for p in range(num_pods)]
    for p in pods[: index.pods_per_key]:
        index.add(p, keys, "GPU")
    wall, cpu = [], []
    for _ in range(runs):
        c0, t0 = time.thread_time(), time.perf_counter()
        scorer.score(keyer.request_keys(tokens), (), pods)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return {"p50": pct(wall, 50) * 1000, "p99": pct(wall, 99) * 1000, "cpu_p99": pct(cpu, 99) * 1000}


def bench_tokenization(
    tokenizer_dir: str | None, prompt_tokens: int, runs: int, seed: int
) -> dict[str, float]:
    if tokenizer_dir is None:
        from tiny_checkpoint import build_tokenizer

        tokenizer_dir = tempfile.mkdtemp(prefix="bench-router-tok-")
        build_tokenizer(tokenizer_dir)
    proc = PromptProcessor.from_pretrained(tokenizer_dir, "bench")
    proc.tokenizer.model_max_length = 1 << 30  # long prompts are the point here
    rng = random.Random(seed)
    lexicon = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8))) for _ in range(5000)]
    words = [rng.choice(lexicon) for _ in range(2 * prompt_tokens)]
    lo, hi = 1, len(words)  # the fewest words that make prompt_tokens tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if len(proc.tokenizer.encode(" ".join(words[:mid]))) >= prompt_tokens:
            hi = mid
        else:
            lo = mid + 1
    text = " ".join(words[:lo])
    times = []
    n = 0
    for _ in tqdm(range(runs), desc="tokenizing", unit="prompt"):
        t0 = time.perf_counter()
        n = proc.tokenize(text).num_tokens
        times.append(time.perf_counter() - t0)
    return {"p50": pct(times, 50) * 1000, "p99": pct(times, 99) * 1000, "tokens": n}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=1_000_000, help="block entries to index")
    p.add_argument("--pods", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--pods-per-key", type=int, default=10)
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--tokenize-runs", type=int, default=30)
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (default: the tiny BPE, built)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    prompt_blocks = args.prompt_tokens // BLOCK
    # Prompts after the first of each (pod, group) store only their suffix.
    num_prompts = max(GROUPS, round(args.blocks / (prompt_blocks - PREFIX_BLOCKS)))
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cpus, python {platform.python_version()}, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    w = Workload(num_prompts, prompt_blocks, args.seed)
    payloads, blocks = build_payloads(w, args.pods, args.seed)
    intake, per_s, per_cpu_s = bench_intake(payloads, blocks, args.pods_per_key)
    index = intake.index
    assert isinstance(index, MemoryIndex)
    index.check_integrity()
    entries = sum(len(v) for v in index.dump().blocks.values())
    print(
        f"indexed {blocks} stored blocks -> {index.size()} keys, {entries} (key, pod) entries, {args.pods} pods"
    )
    print(
        f"intake: {per_s:,.0f} blocks/s wall, {per_cpu_s:,.0f} blocks per CPU-second ({len(payloads)} batches)"
    )
    sc = bench_scoring(w, index, args.pods, args.queries, args.seed)
    print(
        f"scoring {args.prompt_tokens}-token prompts over {args.pods} pods: wall p50 {sc['p50']:.3f} ms, "
        f"p99 {sc['p99']:.3f} ms; CPU p50 {sc['cpu_p50']:.3f} ms, p99 {sc['cpu_p99']:.3f} ms "
        f"(keys p50 {sc['keys_p50']:.3f} ms, lookup+score p50 {sc['lookup_p50']:.3f} ms / p99 "
        f"{sc['lookup_p99']:.3f} ms; {sc['hit_queries']:.0%} of queries hit; {sc['full_gcs']} full GCs)"
    )
    hot = bench_hot_prompt(index, args.pods, args.prompt_tokens, args.queries)
    print(
        f"worst case, one prompt held whole by {args.pods_per_key} pods: wall p50 {hot['p50']:.3f} ms, "
        f"p99 {hot['p99']:.3f} ms; CPU p99 {hot['cpu_p99']:.3f} ms"
    )
    tok = bench_tokenization(args.tokenizer, args.prompt_tokens, args.tokenize_runs, args.seed)
    print(f"tokenization ({tok['tokens']:.0f} tokens): p50 {tok['p50']:.2f} ms, p99 {tok['p99']:.2f} ms")
    print(
        f"SUMMARY bench_router: score_p50_ms={sc['p50']:.3f} score_p99_ms={sc['p99']:.3f} "
        f"score_cpu_p99_ms={sc['cpu_p99']:.3f} score_hot_p99_ms={hot['p99']:.3f} (target<=2) "
        f"tokenize_p50_ms={tok['p50']:.2f} tokenize_p99_ms={tok['p99']:.2f} "
        f"intake_blocks_per_s={per_s:.0f} intake_blocks_per_cpu_s={per_cpu_s:.0f} (target>=200000) "
        f"blocks={blocks} keys={index.size()} pods={args.pods} prompt_tokens={args.prompt_tokens} "
        f"loadavg={os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
