"""Router benchmark: KV event intake from the socket, and scoring latency over a large index.

1. Intake: BlockStored batches as 16 engines emit them (one request's chunked-prefill step of 128
   blocks per batch) are published by a separate process, one ZMQ PUB socket per pod connected to
   the router's bound SUB socket (topic `kv@<pod>@<model>`, as `chunkcache serve` publishes), and
   taken by the router's own `EventIntake` (receiver thread, hand-off to `--event-workers` per-pod
   workers, decode, router keys, `MemoryIndex`) until `--blocks` (1M) block entries are indexed.
   Timed from the first send to the last batch applied. Reported: blocks/s (target >= 200k/s) by
   wall time and per CPU-second of the router process (its receiver, workers and ZMQ I/O thread;
   the publisher's CPU is in the other process; on a shared machine the CPU figure is the one
   neighbours do not move).
2. Scoring, as the router scores a request: an 8k-token chunked RAG prompt as text
   (`S # # D1 # # ... # # D7 # # Q`, S of 512 tokens, 7 documents of ~1090 tokens from a library
   of 64, in random order; the text is sentences of words drawn by Zipf's law from a 50k-word
   random lexicon, with numbers and punctuation) through tokenization (the engine's split and
   per-part tokenization, by the router's WordEncoder unless `--no-word-encoder`), keys (a chunk
   key per part: sha256 over CBOR; block keys over the whole token list only where the policy
   uses them) and index lookups and scores over 16 pods, against the 1M-block index of part 1
   plus chunk claims (each pod's pool holds a random third of the library with its S) and the
   S + first-document prefix blocks an "offset" engine registers. Modes (bench_chunked_scoring):
   first_sight (the router's first prompt: no word known), cold (documents never seen; the word
   cache as 64 other documents left it), cold_prefix_keys (cold plus the block keys prefix_only
   looks up), warm (documents seen before). Target: p99 <= 5 ms for the whole path (wall and
   CPU time of the process), with its parts' p50 beside it.
3. Prefix scoring alone (the longest-prefix path of a plain 8k-token prompt given as token ids):
   router block keys + index lookup + scoring; queries mix prompts one pod holds whole, prompts
   sharing a group's system prefix (held by up to `--pods-per-key` pods), and unseen prompts; then
   the worst case apart: one prompt held whole by `--pods-per-key` pods. Target p99 <= 2 ms.

The intake workload: prompts of `--prompt-tokens` tokens in 8 groups; a group's prompts share a
1024-token system prefix; each prompt is stored by one pod (the first prompt of a group on a pod
stores the prefix, later ones only their suffix, as an engine's prefix cache does).

The tokenizer is the default model's (SmolLM2-135M-Instruct, from its GGUF) when installed, else
the tests' tiny BPE; `--tokenizer DIR` for another one.

Not here: the 3-replica cluster comparison of routing policies, which needs `chunkcache serve`:
`benchmarks/bench_router_cluster.py`.

Usage:
    python benchmarks/bench_router.py
    python benchmarks/bench_router.py --blocks 200000 --queries 100   # quicker
    python benchmarks/bench_router.py --tokenizer DIR                  # another tokenizer

The last line is `SUMMARY bench_router: ...`, each target with "met" or "MISSED".
"""

from __future__ import annotations

import argparse
import gc
import itertools
import multiprocessing as mp
import os
import platform
import random
import string
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from tqdm import tqdm

# The repo root: chunkcache, and tests.support.tiny_checkpoint (the random tokenizer).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chunkcache.kv_events import BlockStored, KVEventBatch, encode_batch
from chunkcache.router.events import EventIntake
from chunkcache.router.index import MemoryIndex
from chunkcache.router.scorer import Scorer
from chunkcache.router.tokens import BlockKeyer, CachedEncoder, PromptProcessor
from chunkcache.router.word_encoder import WordEncoder

BLOCK = 16
GROUPS = 8
PREFIX_BLOCKS = 64  # a 1024-token system prefix shared by a group
BLOCKS_PER_EVENT = 128  # one chunked-prefill step of 2048 tokens
VOCAB = 150_000


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def latencies(**series: list[float]) -> dict[str, float]:
    """p50 and p99 in ms of each series of seconds: `wall` as p50/p99, the others as NAME_p50/p99."""
    out: dict[str, float] = {}
    for name, values in series.items():
        prefix = "" if name == "wall" else f"{name}_"
        out[f"{prefix}p50"] = pct(values, 50) * 1000.0
        out[f"{prefix}p99"] = pct(values, 99) * 1000.0
    return out


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


MODEL = "bench"


def _publish(endpoint: str, messages: list[tuple[str, int, bytes]], ready: Any, go: Any) -> None:
    """The engines' side, in its own process: one PUB socket per pod, connected to the router."""
    ctx = zmq.Context()
    socks: dict[str, zmq.Socket] = {}
    for pod in sorted({m[0] for m in messages}):
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, 0)  # queue everything: a dropped batch would be a seq gap
        sock.connect(endpoint)
        socks[pod] = sock
    time.sleep(1.0)  # the subscriptions reach the publishers (ZMQ's slow joiner)
    ready.set()
    go.wait()
    for pod, seq, payload in messages:
        socks[pod].send_multipart([f"kv@{pod}@{MODEL}".encode(), seq.to_bytes(8, "big"), payload])
    for sock in socks.values():
        sock.close(linger=-1)  # flush what is queued
    ctx.term()


def bench_intake(
    payloads: list[tuple[str, int, bytes]], blocks: int, pods_per_key: int, workers: int
) -> tuple[EventIntake, float, float]:
    """The filled index, and blocks/s by wall time and per CPU-second of this (the router's) process."""
    index = MemoryIndex(capacity=blocks + 1, pods_per_key=pods_per_key)
    intake = EventIntake(index, num_workers=workers, topic_filter="kv@", bind_endpoint="tcp://127.0.0.1:0")
    intake.start()
    assert intake.bound_endpoint is not None
    fork = mp.get_context("fork")  # the child gets the encoded payloads without a copy through a pipe
    ready, go = fork.Event(), fork.Event()
    child = fork.Process(target=_publish, args=(intake.bound_endpoint, payloads, ready, go), daemon=True)
    child.start()
    if not ready.wait(60):
        raise RuntimeError("the publisher process did not start")
    bar = tqdm(total=len(payloads), desc="intake", unit="batch", mininterval=1.0)
    start, start_cpu = time.perf_counter(), time.process_time()
    go.set()
    done = 0
    while done < len(payloads):
        time.sleep(0.005)
        st = intake.stats()
        bar.update(st.batches - done)
        done = st.batches
        if time.perf_counter() - start > 600:
            raise RuntimeError(f"intake stalled at {done}/{len(payloads)} batches: {st}")
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    bar.close()
    child.join(10)
    st = intake.stats()
    assert st.failed == 0 and st.unresolved_blocks == 0 and st.clears == 0, st
    assert st.blocks_stored == blocks, (st.blocks_stored, blocks)
    intake.close()
    return intake, blocks / elapsed, blocks / cpu


def load_processor(tokenizer: str | None) -> tuple[PromptProcessor, str]:
    """The router's prompt processor with the default model's tokenizer (or DIR, or the tiny BPE)."""
    if tokenizer is None:
        try:
            from chunkcache.model.gguf_file import load_gguf_tokenizer
            from chunkcache.model.loader import model_path

            path = Path(model_path("smollm2"))
            return PromptProcessor(load_gguf_tokenizer(path), MODEL), f"{path.name} (GGUF metadata)"
        except Exception as e:  # the default model is an optional install
            print(f"default model's tokenizer unavailable ({e}); using the tiny BPE")
            tokenizer = "tiny"
    if tokenizer == "tiny":
        from tests.support.tiny_checkpoint import build_tokenizer

        tokenizer = tempfile.mkdtemp(prefix="bench-router-tok-")
        build_tokenizer(tokenizer)
        name = "tests' tiny BPE"
    else:
        name = tokenizer
    return PromptProcessor.from_pretrained(tokenizer, MODEL), name


class TextMaker:
    """Texts of exact token counts, made of sentences of words drawn from a 50k-word random
    lexicon by Zipf's law (as natural text: new documents still bring words never seen), with
    capitals, numbers and punctuation (their own parts tokenized alone)."""

    def __init__(self, proc: PromptProcessor, seed: int) -> None:
        self.tok = proc.tokenizer
        self.tok.model_max_length = 1 << 30  # long prompts are the point here
        self.rng = random.Random(seed)
        self.lexicon = [
            "".join(self.rng.choices(string.ascii_lowercase, k=self.rng.randint(2, 9))) for _ in range(50_000)
        ]
        self.cum_weights = list(itertools.accumulate(1.0 / (r + 1) for r in range(len(self.lexicon))))

    def _words(self, n: int) -> list[str]:
        rng = self.rng
        words = rng.choices(self.lexicon, cum_weights=self.cum_weights, k=n)
        out, start = [], True
        for w in words:
            if rng.random() < 0.03:
                w = str(rng.randint(0, 10 ** rng.randint(1, 4)))
            out.append(w.capitalize() if start else w)
            start = rng.random() < 0.07
            if start:
                out[-1] += rng.choice((".", ".", ".", "?", "!", ";"))
            elif rng.random() < 0.05:
                out[-1] += ","
        return out

    def text(self, tokens: int) -> str:
        words = self._words(2 * tokens)
        lo, hi = 1, len(words)  # the fewest words that make `tokens` tokens
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self.tok.encode(" ".join(words[:mid]), add_special_tokens=False)) >= tokens:
                hi = mid
            else:
                lo = mid + 1
        return " ".join(words[:lo])


MODES = ("first_sight", "cold", "cold_prefix_keys", "warm")


def bench_chunked_scoring(
    setup: PromptProcessor,
    make_processor: Any,
    index: MemoryIndex,
    num_pods: int,
    prompt_tokens: int,
    queries: int,
    seed: int,
) -> tuple[dict[str, dict[str, float]], Any]:
    """The router's whole path for a chunked RAG prompt: tokenize, keys, score (see the docstring).
    Modes, each timed with a processor that never tokenized the prompts' documents before:
    - first_sight: the router's first prompt ever (no word of the tokenizer's cache either);
    - cold: the documents never seen, the word cache (WordEncoder) as routing 64 other documents
      of the same language left it, and as the timed prompts themselves fill it;
    - cold_prefix_keys: cold with the block keys over the whole token list, which `prefix_only`
      (and /score) look up and `cache_aware` does not (it scores a chunked prompt by its chunks);
    - warm: the documents seen before, served by the part cache (CachedEncoder).
    Also returns the cold processor's word encoder (its hit statistics)."""
    sep = " # # "
    maker = TextMaker(setup, seed)
    sys_text = maker.text(512)
    doc_tokens = (prompt_tokens - 512 - 64) // 7
    library = [maker.text(doc_tokens) for _ in tqdm(range(64), desc="documents", unit="doc")]
    others = [maker.text(doc_tokens) for _ in tqdm(range(64), desc="other documents", unit="doc")]
    questions = [maker.text(64) for _ in range(16)]
    rng = random.Random(seed + 2)
    pods = [f"pod-{p}" for p in range(num_pods)]
    # Claims, as the engines' chunk events would make them: each pod's pool holds a random third
    # of the library and S; an "offset" engine also registered S and its first document as blocks.
    # Made with their own processor: the timed ones have seen none of these texts.
    proc = setup
    some = proc.tokenize(sep.join([sys_text, library[0], library[1], questions[0]]))
    sys_ids = some.prefix_token_ids
    sys_key = proc.keys(some).chunk_keys[0]
    doc_ids = [proc.tokenize(sep.join([sys_text, d, library[0], questions[0]])).chunks[0] for d in library]
    for pod in pods:
        held = rng.sample(range(len(library)), len(library) // 3)
        first = held[0]
        keys = proc.keys(proc.tokenize(sep.join([sys_text, library[first], library[held[1]], questions[0]])))
        index.add(pod, keys.block_keys[: (len(sys_ids) + len(doc_ids[first])) // BLOCK], "GPU")
        claims = [(sys_key, len(sys_ids))]
        for d in held:
            key = proc.keys(
                proc.tokenize(sep.join([sys_text, library[d], library[0], questions[0]]))
            ).chunk_keys[1]
            claims.append((key, len(doc_ids[d])))
        index.add_chunks(pod, claims)
    scorer = Scorer(index)
    prompts = [
        sep.join([sys_text, *(library[i] for i in rng.sample(range(len(library)), 7)), rng.choice(questions)])
        for _ in range(queries)
    ]
    out: dict[str, dict[str, float]] = {}
    cold: PromptProcessor = make_processor()
    # The router has routed other documents of the same language: its word cache holds their words.
    for doc in others:
        cold.tokenize(sep.join([doc, doc, "q"]))
    cold.parts = CachedEncoder(cold.encoder, capacity_tokens=0)  # no part remembered
    words = cold.encoder if isinstance(cold.encoder, WordEncoder) else None
    if words is not None:
        words.pretokens = words.learned = 0
    for mode in MODES:
        if mode == "first_sight":
            first: PromptProcessor = make_processor()
            first.parts = CachedEncoder(first.encoder, capacity_tokens=0)
            fresh = first.encoder._ids.clear if isinstance(first.encoder, WordEncoder) else None
            out[mode] = _time_scoring(first, scorer, pods, prompts, len(sys_ids), mode, fresh, False)
        elif mode == "cold":
            out[mode] = _time_scoring(cold, scorer, pods, prompts, len(sys_ids), mode, None, False)
            if words is not None:
                out[mode]["word_hits"] = 1 - words.learned / max(words.pretokens, 1)
        elif mode == "cold_prefix_keys":
            out[mode] = _time_scoring(cold, scorer, pods, prompts, len(sys_ids), mode, None, True)
        else:
            warm: PromptProcessor = make_processor()
            for doc in library:
                warm.tokenize(sep.join([sys_text, doc, library[0], questions[0]]))
            out[mode] = _time_scoring(warm, scorer, pods, prompts, len(sys_ids), mode, None, False)
    return out, words


def _time_scoring(
    proc: PromptProcessor,
    scorer: Scorer,
    pods: list[str],
    prompts: list[str],
    sys_len: int,
    mode: str,
    before_each: Any,
    block_keys: bool,
) -> dict[str, float]:
    wall, cpu, tok_s, keys_s, score_s, tokens, chunk_hits = [], [], [], [], [], [], 0
    for text in tqdm(prompts, desc=f"scoring chunked ({mode})", unit="prompt"):
        if before_each is not None:
            before_each()
        # process_time, not thread_time: CPU of any helper thread counts too.
        c0, t0 = time.process_time(), time.perf_counter()
        tokenized = proc.tokenize(text)
        t1 = time.perf_counter()
        keys = proc.keys(tokenized, chunked_block_keys=block_keys)
        t2 = time.perf_counter()
        scores = scorer.score(keys.block_keys, keys.chunk_keys, pods, chunk_tokens=keys.chunk_tokens)
        t3 = time.perf_counter()
        cpu.append(time.process_time() - c0)
        wall.append(t3 - t0)
        tok_s.append(t1 - t0)
        keys_s.append(t2 - t1)
        score_s.append(t3 - t2)
        tokens.append(tokenized.num_tokens)
        chunk_hits += max(s.chunk_tokens for s in scores.values()) > sys_len
    return {
        **latencies(wall=wall, cpu=cpu, tokenize=tok_s, keys=keys_s, score=score_s),
        "tokens": float(np.mean(tokens)),
        "chunk_hit_queries": chunk_hits / len(prompts),
    }


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
    return {
        **latencies(wall=wall, cpu=cpu, keys=keys_s, lookup=lookup_s),
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


def verdict(value: float, target: float, at_most: bool) -> str:
    ok = value <= target if at_most else value >= target
    return f"(target{'<=' if at_most else '>='}{target:g}: {'met' if ok else 'MISSED'})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=1_000_000, help="block entries to index")
    p.add_argument("--pods", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=8192)
    p.add_argument("--pods-per-key", type=int, default=10)
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--event-workers", type=int, default=4, help="the router's intake workers (its default)")
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer dir, or 'tiny' (default: the default model's)"
    )
    p.add_argument(
        "--no-word-encoder",
        action="store_true",
        help="tokenize through transformers' tokenizer only (the router without its WordEncoder)",
    )
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
    intake, per_s, per_cpu_s = bench_intake(payloads, blocks, args.pods_per_key, args.event_workers)
    index = intake.index
    assert isinstance(index, MemoryIndex)
    index.check_integrity()
    entries = sum(len(v) for v in index.dump().blocks.values())
    print(
        f"indexed {blocks} stored blocks -> {index.size()} keys, {entries} (key, pod) entries, {args.pods} pods"
    )
    print(
        f"intake, ZMQ socket to index ({args.event_workers} workers): {per_s:,.0f} blocks/s wall, "
        f"{per_cpu_s:,.0f} blocks per CPU-second of the router process ({len(payloads)} batches)"
    )
    proc, tok_name = load_processor(args.tokenizer)
    tokenizer = proc.tokenizer
    # The claims are made with the tokenizer itself, the timed processors use the router's
    # default (the word encoder, unless --no-word-encoder): every query finding its documents
    # shows their keys agree.
    setup = PromptProcessor(tokenizer, MODEL, word_encoder=False)

    def make_processor() -> PromptProcessor:
        return PromptProcessor(tokenizer, MODEL, word_encoder=not args.no_word_encoder)

    encoder = type(make_processor().encoder).__name__
    chunked, _ = bench_chunked_scoring(
        setup, make_processor, index, args.pods, args.prompt_tokens, args.queries, args.seed
    )
    for mode, ch in chunked.items():
        extra = f", {ch['word_hits']:.1%} of pre-tokens from the word cache" if "word_hits" in ch else ""
        print(
            f"chunked prompt, {mode}, tokenize + keys + score ({ch['tokens']:.0f} tokens, 7 documents, "
            f"tokenizer {tok_name} through {encoder}): wall p50 {ch['p50']:.3f} ms, p99 {ch['p99']:.3f} ms; "
            f"CPU p50 {ch['cpu_p50']:.3f} ms, p99 {ch['cpu_p99']:.3f} ms (tokenize p50 "
            f"{ch['tokenize_p50']:.3f} / p99 {ch['tokenize_p99']:.3f} ms, keys p50 {ch['keys_p50']:.3f} ms, "
            f"lookups+scores p50 {ch['score_p50']:.3f} / p99 {ch['score_p99']:.3f} ms; "
            f"{ch['chunk_hit_queries']:.0%} of queries found documents{extra})"
        )
    sc = bench_scoring(w, index, args.pods, args.queries, args.seed)
    print(
        f"prefix scoring of {args.prompt_tokens}-token token lists over {args.pods} pods: wall p50 "
        f"{sc['p50']:.3f} ms, p99 {sc['p99']:.3f} ms; CPU p50 {sc['cpu_p50']:.3f} ms, p99 {sc['cpu_p99']:.3f} ms "
        f"(keys p50 {sc['keys_p50']:.3f} ms, lookup+score p50 {sc['lookup_p50']:.3f} ms / p99 "
        f"{sc['lookup_p99']:.3f} ms; {sc['hit_queries']:.0%} of queries hit; {sc['full_gcs']} full GCs)"
    )
    hot = bench_hot_prompt(index, args.pods, args.prompt_tokens, args.queries)
    print(
        f"worst case, one prompt held whole by {args.pods_per_key} pods: wall p50 {hot['p50']:.3f} ms, "
        f"p99 {hot['p99']:.3f} ms; CPU p99 {hot['cpu_p99']:.3f} ms"
    )
    print(
        "SUMMARY bench_router: "
        + "".join(
            f"chunked_{mode}_p99_ms={ch['p99']:.3f} {verdict(ch['p99'], 5, True)} "
            f"chunked_{mode}_cpu_p99_ms={ch['cpu_p99']:.3f} {verdict(ch['cpu_p99'], 5, True)} "
            f"chunked_{mode}_tokenize_p99_ms={ch['tokenize_p99']:.3f} "
            for mode, ch in chunked.items()
        )
        + f"encoder={encoder} "
        + (f"cold_word_hits={chunked['cold']['word_hits']:.3f} " if "word_hits" in chunked["cold"] else "")
        + f"prefix_score_p99_ms={sc['p99']:.3f} {verdict(sc['p99'], 2, True)} "
        f"prefix_score_cpu_p99_ms={sc['cpu_p99']:.3f} {verdict(sc['cpu_p99'], 2, True)} "
        f"hot_p99_ms={hot['p99']:.3f} {verdict(hot['p99'], 2, True)} "
        f"intake_blocks_per_s={per_s:.0f} {verdict(per_s, 200000, False)} "
        f"intake_blocks_per_cpu_s={per_cpu_s:.0f} {verdict(per_cpu_s, 200000, False)} "
        f"blocks={blocks} keys={index.size()} pods={args.pods} prompt_tokens={args.prompt_tokens} "
        f"loadavg={os.getloadavg()[0]:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
