"""bench_llamacpp's RAG random-order requests in process, chunkcache alone: TTFT without the
server, llama.cpp or HTTP, for comparing two commits (run it from each one's tree, alternated;
bench_llamacpp's own numbers move with the VM between its runs).

The same prompts as bench_llamacpp's `rag_random` (its seed, document pool and separator): 12
documents of `--doc-tokens`, every one seen once by warm-up requests, then `--requests` requests
of 4 drawn at random in a random order with a fresh question, each timed to its first token.

`--steps`: each request's engine steps too (rows, sequences and seconds of each
`ModelRunner.run`: under fusion the streams' question rows, then the pair stream's).

    OMP_NUM_THREADS=1 python benchmarks/bench_rag_inprocess.py [--model qwen2.5-coder-1.5b] [--requests 6] [--steps]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from bench_llamacpp import SEPARATOR, SYSTEM, question
from common import passages
from tqdm import tqdm

from chunkcache import LLM, SamplingParams
from chunkcache.engine.runner import ModelRunner
from chunkcache.engine.scheduler import ScheduledBatch


def time_steps(steps: list[tuple[int, int, float]]) -> None:
    """Append (rows, sequences, seconds) for every `ModelRunner.run` from now on."""
    run = ModelRunner.run

    def timed(self: ModelRunner, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        start = time.perf_counter()
        out = run(self, batch)
        steps.append((sum(batch.num_new_tokens), len(batch.seqs), time.perf_counter() - start))
        return out

    ModelRunner.run = timed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--doc-tokens", type=int, default=250)
    parser.add_argument("--requests", type=int, default=6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", action="store_true", help="print each request's engine steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model)
    rng = random.Random(args.seed)
    pool = passages(llm.tokenizer, args.doc_tokens)
    rng.shuffle(pool)
    docs = pool[:12]
    titles = [title for title, _ in docs]
    one = SamplingParams(max_tokens=1, temperature=0)

    def prompt(chosen: list[tuple[str, str]]) -> str:
        return SEPARATOR.join([SYSTEM, *[text for _, text in chosen], question(rng, titles)])

    for i in range(0, len(docs), 4):  # every document seen once
        llm.generate([prompt(docs[i : i + 4])], one)
    ttfts: list[float] = []
    steps: list[tuple[int, int, float]] = []
    if args.steps:
        time_steps(steps)
    for _ in tqdm(range(args.requests), desc="rag_random"):
        text = prompt(rng.sample(docs, 4))
        steps.clear()
        start = time.perf_counter()
        llm.generate([text], one)
        ttfts.append(time.perf_counter() - start)
        if args.steps:
            tqdm.write(
                f"TTFT {ttfts[-1]:.2f} s: "
                + " | ".join(f"{r} rows / {n} seqs {t:.2f} s" for r, n, t in steps)
            )
    print("TTFT s:", " ".join(f"{t:.2f}" for t in ttfts))
    print(
        f"SUMMARY bench_rag_inprocess: model={args.model} requests={args.requests} "
        f"ttft_median_s={statistics.median(ttfts):.2f} ttft_mean_s={statistics.fmean(ttfts):.2f}"
    )


if __name__ == "__main__":
    main()
