"""Time to first token of a chunked RAG prompt `S # # C1 # # ... # # Cn # # Q`: plain, cold, warm, floor.

Checkpoint: `--model` (a directory or .gguf file; `--model smollm2` = SmolLM2-135M-Instruct), else
the random Qwen2.5-0.5B-shaped one of bench_engine (built on first use); fp32, CPU.
Shapes: S = 128 tokens (BOS included), n = 4 chunks of 1024 tokens, Q = 64 tokens, 16 new tokens
(greedy, EOS ignored). Texts are random words of exactly those token counts (each part tokenized on
its own, as the engine does), fresh from a seeded RNG, so no two chunks share content.

Two engines side by side in one process, same `max_num_batched_tokens` (default 16384, so every
prefill below is one step: chunked prefill would only make the plain baseline slower):
- plain: `enable_chunk_cache=False, enable_prefix_caching=False`: the same prompt text is an
  ordinary prompt (the separators are ordinary text, ~4.3k tokens), computed in full every time.
- chunk: `enable_chunk_cache=True, chunk_layout="isolated"`, prefix caching on (the default).

Measured 3 times each (median), in every repetition side by side (plain, cold, warm, floor; the
order alternates between repetitions), a fresh S and fresh chunks per repetition:
- plain: that prompt through the plain engine;
- cold: the same prompt through the chunk engine, nothing of it cached (S and every chunk miss):
  S is computed, then the n chunks (one batched step), then Q;
- warm: the same S and chunks again, in a different order, with a fresh Q: every chunk hits, only
  the 64 Q tokens are computed, attending over the assembled [S | C...] KV list (4224 tokens);
- floor: the least work any engine must do for the warm request: a 64-token prefill attending
  over 4224 tokens of KV that is already in place. Measured on the same chunk engine through the
  ordinary prefix-cache path, with no chunk machinery: a token-id prompt made of a fixed
  4224-token prefix (random ids, 264 full blocks, put in the prefix cache once by an untimed
  priming request) followed by a fresh 64-token Q. The prefix cache serves all 4224 tokens
  (checked), so exactly the 64 Q tokens are computed over a 4224-token context: the shape of the
  warm request (the context's content and the RoPE positions differ, which costs nothing). The
  floor still pays the engine's ordinary per-request costs (scheduling, one forward, sampling), so
  warm / floor is the overhead of the chunk path itself: parsing and tokenizing the parts,
  hashing and looking up S and the chunks, assembling the borrowed slot list.

TTFT = client-side wall time from just before `LLMEngine.add_request` (so parsing and tokenizing
the prompt count) to the return of the `step()` that produced the first token; then the request
runs to its 16 tokens. (`RequestOutput.metrics.ttft` starts after tokenization; it is printed for
the main runs as a cross-check.) The process CPU time to the first token is recorded too: with
`--threads 1` it hardly depends on the load other processes put on a shared machine, while wall
time does; the summary line carries both (`cpu_*` keys for the CPU-time ratios).

Also: the warm/plain ratio at 1, 2, 4 and 8 chunks (same S; the 1- and 2-chunk requests reuse
chunks already cached, the 8-chunk set adds 4 chunks cached by one priming request).

Targets: warm >= 20x faster than plain; warm <= 1.3x floor; cold <= 1.0x plain.

    python benchmarks/bench_chunk_cache.py [--quick] [--model DIR|FILE.gguf|default] [--model-dir DIR] [--repeats 3] [--threads N]

The last line is `SUMMARY bench_chunk_cache: warm_vs_plain=XX.Xx warm_vs_floor=X.XXx
cold_vs_plain=X.XXx cpu_warm_vs_plain=... cpu_warm_vs_floor=... cpu_cold_vs_plain=...`.
"""

from __future__ import annotations

import argparse
import itertools
import random
from dataclasses import dataclass
from typing import Any

from common import (
    QUICK_CHUNK_SHAPES,
    SEP,
    ChunkShapes,
    TextMaker,
    add_common_args,
    bench_model,
    chunked_prompt,
    describe_machine,
    first_token_time,
    fmt_runs,
    median,
    ordinary_token_ids,
    random_token_ids,
    setup_torch,
    summary,
)
from tqdm import tqdm

from chunkcache import LLM, SamplingParams
from chunkcache.outputs import RequestOutput


@dataclass(frozen=True)
class Shapes(ChunkShapes):
    scan: tuple[int, ...] = (1, 2, 4, 8)


QUICK = Shapes(**vars(QUICK_CHUNK_SHAPES))


def log(msg: str) -> None:
    tqdm.write(msg)


class Bench:
    def __init__(self, args: argparse.Namespace, shapes: Shapes, model: str) -> None:
        self.shapes = shapes
        common: dict[str, Any] = {
            "device": "cpu",
            "dtype": "float32",
            "max_num_batched_tokens": args.max_num_batched_tokens,
            # The engine sets torch's (process-wide) threads: the same number for every side.
            "threads": args.threads,
        }
        self.plain = LLM(model, enable_chunk_cache=False, enable_prefix_caching=False, **common)
        # Layout "isolated" explicitly: this measures pure reuse (the engine's default is now
        # "offset" + blend, whose TTFT and answers bench_fidelity measures).
        self.chunk = LLM(model, enable_chunk_cache=True, chunk_layout="isolated", **common)
        self.tok = self.chunk.tokenizer
        self.maker = TextMaker(self.tok, args.seed)
        self.rng = random.Random(args.seed)
        self.vocab = ordinary_token_ids(self.tok, self.chunk.engine.spec.vocab_size)
        self.params = SamplingParams(temperature=0.0, max_tokens=shapes.new_tokens, ignore_eos=True)
        self._ids = itertools.count()
        self.last_cpu = 0.0

    # ---- prompts -------------------------------------------------------------------------------

    def new_sys(self) -> str:
        return self.maker.text(self.shapes.sys_len, special=True)

    def new_chunks(self, n: int) -> list[str]:
        return [self.maker.text(self.shapes.chunk_len) for _ in range(n)]

    def new_q(self) -> str:
        return self.maker.text(self.shapes.q_len)

    def prompt(self, sys: str, chunks: list[str], q: str) -> str:
        return chunked_prompt(self.tok, self.shapes, sys, chunks, q)[0]

    def kv_list_ids(self, sys: str, chunks: list[str]) -> list[int]:
        """The token ids of a chunked request's assembled KV list [S | C1 | ... | Cn]."""
        ids = list(self.tok.encode(sys, add_special_tokens=True))
        for c in chunks:
            ids.extend(self.tok.encode(c, add_special_tokens=False))
        return ids

    # ---- one timed request ---------------------------------------------------------------------

    def ttft(self, llm: LLM, prompt: str | list[int]) -> tuple[float, RequestOutput]:
        """Wall-clock TTFT of one request (run to its end); its process CPU TTFT goes to self.cpu."""
        wall, self.last_cpu, final = first_token_time(
            llm.engine, f"bench-{next(self._ids)}", prompt, self.params
        )
        assert len(final.outputs[0].token_ids) == self.shapes.new_tokens
        return wall, final


def reorder(chunks: list[str], rng: random.Random) -> list[str]:
    """A permutation of `chunks` different from the given order (when there are several)."""
    if len(chunks) < 2:
        return list(chunks)
    while True:
        out = list(chunks)
        rng.shuffle(out)
        if out != chunks:
            return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement (median)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    args = parser.parse_args()
    setup_torch(args.threads)
    shapes = QUICK if args.quick else Shapes()
    model = bench_model(args)
    log(f"machine: {describe_machine()}")
    log(f"checkpoint: {model}  shapes: {shapes}  max_num_batched_tokens={args.max_num_batched_tokens}")
    b = Bench(args, shapes, model)
    reps = args.repeats
    n, c = shapes.num_chunks, shapes.chunk_len
    kv_len = shapes.sys_len + n * c

    # ---- warm-up: every path once (plain, cold, warm, prefix-cache hit) -------------------------
    for _ in tqdm(range(2), desc="warm-up"):
        sys, chunks = b.maker.text(16, special=True), [b.maker.text(48) for _ in range(3)]
        text = SEP.join([sys, *chunks, b.maker.text(8)])
        b.ttft(b.plain, text)
        b.ttft(b.chunk, text)
        b.ttft(b.chunk, SEP.join([sys, *chunks[::-1], b.maker.text(8)]))
        ids = random_token_ids(b.rng, 64, b.vocab)
        b.ttft(b.chunk, ids)
        b.ttft(b.chunk, ids[:48] + random_token_ids(b.rng, 16, b.vocab))

    # ---- main: plain, cold, warm, floor at n chunks, side by side in every repetition ----------
    # The floor's context: a 4224-token prefix in the prefix cache (primed once, untimed). Its
    # content does not matter to the cost; each floor request adds a fresh Q.
    floor_prefix = random_token_ids(b.rng, kv_len, b.vocab)
    b.ttft(b.chunk, floor_prefix + random_token_ids(b.rng, shapes.q_len, b.vocab))
    bs = b.chunk.engine.blocks.block_size
    plain_t: list[float] = []
    cold_t: list[float] = []
    warm_t: list[float] = []
    floor_t: list[float] = []
    metrics_ttft: dict[str, list[float]] = {"plain": [], "cold": [], "warm": []}
    cpu: dict[str, list[float]] = {"plain": [], "cold": [], "warm": [], "floor": []}
    sets: list[tuple[str, list[str]]] = []
    plain_len = floor_computed = floor_cached = 0
    bar = tqdm(total=4 * reps, desc=f"plain/cold/warm/floor, {n} chunks")
    for r in range(reps):
        sys, chunks = b.new_sys(), b.new_chunks(n)
        sets.append((sys, chunks))
        text = b.prompt(sys, chunks, b.new_q())

        def plain_run(text: str = text) -> None:
            nonlocal plain_len
            t, out = b.ttft(b.plain, text)
            assert out.num_cached_tokens == 0
            plain_len = len(out.prompt_token_ids)
            plain_t.append(t)
            cpu["plain"].append(b.last_cpu)
            metrics_ttft["plain"].append(out.metrics.ttft or 0.0)
            bar.update()

        def cold_run(text: str = text) -> None:
            t, out = b.ttft(b.chunk, text)
            assert out.num_chunk_cached_tokens == 0 and out.num_cached_tokens == 0, out
            cold_t.append(t)
            cpu["cold"].append(b.last_cpu)
            metrics_ttft["cold"].append(out.metrics.ttft or 0.0)
            bar.update()

        def warm_run(sys: str = sys, chunks: list[str] = chunks) -> None:
            t, out = b.ttft(b.chunk, b.prompt(sys, reorder(chunks, b.rng), b.new_q()))
            assert out.num_chunk_cached_tokens == n * c, out.num_chunk_cached_tokens
            assert out.num_computed_tokens == shapes.q_len, out.num_computed_tokens
            warm_t.append(t)
            cpu["warm"].append(b.last_cpu)
            metrics_ttft["warm"].append(out.metrics.ttft or 0.0)
            bar.update()

        def floor_run() -> None:
            nonlocal floor_computed, floor_cached
            t, out = b.ttft(b.chunk, floor_prefix + random_token_ids(b.rng, shapes.q_len, b.vocab))
            floor_t.append(t)
            cpu["floor"].append(b.last_cpu)
            floor_computed = out.num_computed_tokens
            floor_cached = out.num_prefix_cached_tokens
            assert floor_cached == kv_len // bs * bs, floor_cached
            bar.update()

        # Alternate the order, so that a drift of the machine's load favours no side.
        order = (plain_run, cold_run, warm_run, floor_run)
        if r % 2 == 1:
            order = (cold_run, floor_run, warm_run, plain_run)
        for run in order:
            run()
    bar.close()
    sys0, chunks0 = sets[0]

    plain_m, cold_m, warm_m, floor_m = map(median, (plain_t, cold_t, warm_t, floor_t))
    warm_vs_plain = plain_m / warm_m
    warm_vs_floor = warm_m / floor_m
    cold_vs_plain = cold_m / plain_m
    log(
        f"TTFT, S={shapes.sys_len} + {n} chunks x {c} + Q={shapes.q_len} tokens "
        f"(plain prompt {plain_len} tokens incl. separators; chunked KV list {kv_len} + Q), "
        f"median of {reps}:\n"
        f"  plain prefill  {fmt_runs(plain_t, 'ms', 1e3)}\n"
        f"  cold           {fmt_runs(cold_t, 'ms', 1e3)}\n"
        f"  warm           {fmt_runs(warm_t, 'ms', 1e3)}\n"
        f"  floor          {fmt_runs(floor_t, 'ms', 1e3)}  ({floor_computed} tokens computed over "
        f"{floor_cached} prefix-cached)\n"
        f"  (engine metrics.ttft, from after tokenization: plain {median(metrics_ttft['plain']) * 1e3:.4g} ms, "
        f"cold {median(metrics_ttft['cold']) * 1e3:.4g} ms, warm {median(metrics_ttft['warm']) * 1e3:.4g} ms)\n"
        f"  process CPU seconds to the first token: "
        + ", ".join(f"{k} {median(v) * 1e3:.4g} ms" for k, v in cpu.items())
        + f" (ratios: warm vs plain {median(cpu['plain']) / median(cpu['warm']):.1f}x, "
        f"warm vs floor {median(cpu['warm']) / median(cpu['floor']):.2f}x, "
        f"cold vs plain {median(cpu['cold']) / median(cpu['plain']):.2f}x)\n"
        f"  warm vs plain: {warm_vs_plain:.1f}x faster (target >= 20x)\n"
        f"  warm vs floor: {warm_vs_floor:.2f}x the floor (target <= 1.3x)\n"
        f"  cold vs plain: {cold_vs_plain:.2f}x plain (target <= 1.0x)"
    )

    # ---- warm/plain at 1, 2, 4, 8 chunks -------------------------------------------------------
    scan: dict[int, tuple[float, float]] = {n: (plain_m, warm_m)}
    # The plain prompt must fit the model's context (SmolLM2: 8192 tokens, so not 8 chunks of 1024).
    limit = b.plain.engine.max_model_len
    fits = [
        k for k in shapes.scan if shapes.sys_len + k * (c + 4) + shapes.q_len + shapes.new_tokens <= limit
    ]
    skipped = [k for k in shapes.scan if k not in fits]
    if skipped:
        log(f"chunk-count scan: {skipped} chunks skipped, longer than max_model_len {limit}")
    extra = [k for k in fits if k != n]
    bar = tqdm(total=2 * reps * len(extra), desc="chunk-count scan")
    pool_chunks = list(chunks0)
    for k in extra:
        if k > len(pool_chunks):
            pool_chunks += b.new_chunks(k - len(pool_chunks))
            # Prime the new chunks (the old ones hit); not timed.
            b.ttft(b.chunk, b.prompt(sys0, pool_chunks[:k], b.new_q()))
        p_t: list[float] = []
        w_t: list[float] = []
        p_cpu: list[float] = []
        w_cpu: list[float] = []
        for r in range(reps):
            chunks = reorder(pool_chunks[:k], b.rng) if k > 1 else [pool_chunks[r % len(pool_chunks)]]
            text = b.prompt(sys0, chunks, b.new_q())
            warm_text = b.prompt(sys0, reorder(chunks, b.rng), b.new_q())

            for kind in ("plain", "warm") if r % 2 == 0 else ("warm", "plain"):
                if kind == "plain":
                    t, _ = b.ttft(b.plain, text)
                    p_t.append(t)
                    p_cpu.append(b.last_cpu)
                else:
                    t, out = b.ttft(b.chunk, warm_text)
                    assert out.num_chunk_cached_tokens == k * c, (k, out.num_chunk_cached_tokens)
                    w_t.append(t)
                    w_cpu.append(b.last_cpu)
                bar.update()
        scan[k] = (median(p_t), median(w_t))
        tqdm.write(
            f"  {k} chunks: plain {fmt_runs(p_t, 'ms', 1e3)}, warm {fmt_runs(w_t, 'ms', 1e3)}, "
            f"warm/plain {median(p_t) / median(w_t):.1f}x (CPU time {median(p_cpu) / median(w_cpu):.1f}x)"
        )
    bar.close()
    log("warm vs plain by chunk count (plain / warm TTFT, medians):")
    for k in sorted(scan):
        p, w = scan[k]
        log(f"  {k} chunks: plain {p * 1e3:9.1f} ms  warm {w * 1e3:8.1f} ms  -> {p / w:6.1f}x")
    stats = b.chunk.chunk_cache_stats() or {}
    log(
        "chunk cache: "
        + ", ".join(
            f"{k}={stats[k]}" for k in ("hits", "misses", "entries", "bytes", "evictions") if k in stats
        )
    )
    b.chunk.check_integrity()
    print(
        summary(
            "bench_chunk_cache",
            warm_vs_plain=f"{warm_vs_plain:.1f}x",
            warm_vs_floor=f"{warm_vs_floor:.2f}x",
            cold_vs_plain=f"{cold_vs_plain:.2f}x",
            cpu_warm_vs_plain=f"{median(cpu['plain']) / median(cpu['warm']):.1f}x",
            cpu_warm_vs_floor=f"{median(cpu['warm']) / median(cpu['floor']):.2f}x",
            cpu_cold_vs_plain=f"{median(cpu['cold']) / median(cpu['plain']):.2f}x",
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
