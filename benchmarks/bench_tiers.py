"""Time to first token of a chunked prompt whose documents come from each chunk tier, or are recomputed.

Checkpoint: `--model` (a directory or .gguf file; `--model smollm2` = SmolLM2-135M-Instruct), else
the random Qwen2.5-0.5B-shaped one of bench_engine (built on first use); fp32, CPU.
Shapes: S = 128 tokens, 4 chunks of 1024 tokens, Q = 64 tokens, 16 new tokens (`--quick`: 32,
4 x 128, 16, 4). Layout "isolated", so a request with every entry cached computes only Q.

Two engines in one process share a real `redis-server` (started here on a free loopback port):
replica A has a disk tier (a temporary directory) above the remote tier, replica B the remote tier
only. Per repetition, a fresh S and fresh documents (so every entry is new everywhere):
- recompute: A answers the prompt cold: S and the 4 documents are computed (and written through
  to disk and Redis in the background; the writes are flushed, untimed, before the next step);
- pool: A answers the same documents with a fresh Q: every entry is in its device pool;
- disk: A's pool is emptied (`reset_chunk_cache`), then a fresh Q: every entry comes from disk
  (read, checksum, copy into the pool);
- remote: replica B, which has never seen these documents, answers a fresh Q: every entry comes
  from Redis (the two-replica case: B's first sight of a document is a remote hit).
There is no host-memory tier: on a CPU the device pool is host memory (docs/operations.md).

TTFT = wall time from just before `add_request` to the step that produced the first token
(common.first_token_time). Median of `--repeats` repetitions; the order within one repetition is
fixed by the dependencies above.

Targets: disk and remote TTFT <= 1/3 of recompute.

    python benchmarks/bench_tiers.py [--quick] [--model DIR|FILE.gguf|default] [--repeats 3] [--threads 1]

The last line is `SUMMARY bench_tiers: recompute_vs_disk=X.Xx recompute_vs_remote=X.Xx
pool_vs_disk=X.XXx ...`.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from common import (
    QUICK_CHUNK_SHAPES,
    ChunkShapes,
    TextMaker,
    add_common_args,
    bench_model,
    chunked_prompt,
    describe_machine,
    first_token_time,
    fmt_runs,
    median,
    setup_torch,
    summary,
)

from chunkcache import SamplingParams
from chunkcache.engine.engine import LLMEngine
from tests.support.redis_server import REDIS_BIN, RedisServer

SOURCES = ("recompute", "pool", "disk", "remote")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    setup_torch(args.threads)
    shapes = QUICK_CHUNK_SHAPES if args.quick else ChunkShapes()
    model = bench_model(args)
    print(describe_machine())
    print(f"model {model}; shapes {shapes}; threads {args.threads}")
    work = Path(tempfile.mkdtemp(prefix="bench_tiers-"))
    if REDIS_BIN is None:
        raise SystemExit("bench_tiers needs redis-server on PATH (apt-get install redis-server)")
    redis_server = RedisServer(work)  # the tests' real redis-server on a free loopback port
    redis_server.start()
    url = redis_server.url
    options = {
        "device": "cpu",
        "dtype": "float32",  # as documented above; auto would be bfloat16 on bf16 CPUs
        "chunk_layout": "isolated",
        "chunk_cache_size_gb": 1.0,
        "kv_cache_tokens": 8192,
        "max_num_batched_tokens": 16384,
        "threads": args.threads,
        "chunk_cache_remote": url,
    }
    replicas: list[LLMEngine] = []
    try:
        a = LLMEngine.from_options(model, chunk_cache_disk_dir=str(work / "disk"), **options)
        replicas.append(a)
        b = LLMEngine.from_options(model, **options)
        replicas.append(b)
        texts = TextMaker(a.tokenizer, args.seed)
        params = SamplingParams(temperature=0.0, max_tokens=shapes.new_tokens, ignore_eos=True)
        runs: dict[str, list[float]] = {s: [] for s in SOURCES}
        for rep in range(args.repeats + 1):  # repetition 0 warms up, untimed
            sys_text = texts.text(shapes.sys_len, special=True)
            docs = [texts.text(shapes.chunk_len) for _ in range(shapes.num_chunks)]
            took: dict[str, float] = {}
            for source in SOURCES:
                prompt, _ = chunked_prompt(a.tokenizer, shapes, sys_text, docs, texts.text(shapes.q_len))
                engine = b if source == "remote" else a
                if source == "disk":
                    a.reset_chunk_cache()
                ttft, _, out = first_token_time(engine, f"{source}-{rep}", prompt, params)
                expected_cached = (
                    0 if source == "recompute" else shapes.sys_len + shapes.num_chunks * shapes.chunk_len
                )
                assert out.num_cached_tokens == expected_cached, (source, out.num_cached_tokens)
                took[source] = ttft
                a.flush_chunk_tiers()
            if rep > 0:
                for source, t in took.items():
                    runs[source].append(t)
            print(
                f"rep {rep}{' (warm-up)' if rep == 0 else ''}: "
                + "  ".join(f"{s} {t * 1000:.1f} ms" for s, t in took.items())
            )
        for engine, name in ((a, "A"), (b, "B")):
            tiers = engine.chunk_cache_stats()["tiers"]  # type: ignore[index]
            print(
                f"replica {name} tiers: "
                + "; ".join(
                    f"{t}: hits {s['hits']} misses {s['misses']} stores {s['stores']}"
                    for t, s in tiers.items()
                )
            )
    finally:
        for engine in replicas:
            engine.close()
        redis_server.stop()
        shutil.rmtree(work, ignore_errors=True)
    med = {s: median(v) for s, v in runs.items()}
    for source in SOURCES:
        print(f"{source:>9}: TTFT {fmt_runs(runs[source], 'ms', 1000)}")
    print("host: no tier on CPU (the device pool is host memory)")
    print(
        summary(
            "bench_tiers",
            recompute_vs_disk=f"{med['recompute'] / med['disk']:.1f}x",
            recompute_vs_remote=f"{med['recompute'] / med['remote']:.1f}x",
            recompute_vs_pool=f"{med['recompute'] / med['pool']:.1f}x",
            disk_vs_pool=f"{med['disk'] / med['pool']:.2f}x",
            remote_vs_pool=f"{med['remote'] / med['pool']:.2f}x",
        )
    )


if __name__ == "__main__":
    main()
