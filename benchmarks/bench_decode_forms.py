"""Decode steps with one serving choice on and off, swapped in place and alternated round by round in
one process, so a shared machine's drift falls on both alike (separate processes measured +-15%
apart on the same code).

`--compare rows`: a decode step of `--sequences` sequences with every row's activations rounded to
int8 (`qkernel.decode_step`, the runner's marking of decode-only steps; `int8_activations`)
against the previous behaviour, int8 x for 1-row products only (the steps left unmarked: 2+ rows
run float32 x). `--compare lm_head`: a tied Q8_0 lm_head held as the file's blocks (`BlocksPart`)
against a dense float32 copy of the same values (SmolLM2's before Q8_0 had a kernel), or with
`--dtype auto` a dense bfloat16 one (on AMX tiles where they serve). `--compare blocks_rows` (with
`--dtype auto`, int8 activations as the 1.5B is served): Q4_K's and Q6_K's products of 6+ rows on
the AMX blocks (`quant_blocks.BLOCK_FORMATS`) against the old thresholds (12 and 8 rows; below
them the int8-x kernel, a pass per 8 rows). `--compare c_rows` (with
`--dtype auto` on a CPU that serves bfloat16): a bfloat16 decode row's norms, one sequence's
attention and the products' residual adds / SwiGLU as C calls (`qkernel_row.c`) against torch's
operators.

Per round and side: one 1-token generate (the prompts' prefill), then a `--tokens`+1-token one;
the CPU time (time.process_time) of the difference over `--tokens` steps is a decode step.

    OMP_NUM_THREADS=1 python benchmarks/bench_decode_forms.py --compare rows [--model qwen2.5-coder-1.5b] [--sequences 5]
    OMP_NUM_THREADS=1 python benchmarks/bench_decode_forms.py --compare lm_head --model smollm2 --sequences 1 --tokens 64
    OMP_NUM_THREADS=1 python benchmarks/bench_decode_forms.py --compare c_rows --model smollm2 --sequences 1 --tokens 128 --dtype auto
    OMP_NUM_THREADS=1 python benchmarks/bench_decode_forms.py --compare blocks_rows --sequences 8 --dtype auto
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from chunkcache import LLM, SamplingParams
from chunkcache.model.kernels import qkernel
from chunkcache.model.kernels.quant_blocks import BlocksPart
from chunkcache.model.linear import Linear
from chunkcache.model.quant import DensePart, QuantProduct

PROMPTS = [
    "def quicksort(xs):",
    "The capital of France is",
    "In 1905 Albert Einstein published",
    "SELECT name FROM users WHERE",
    "The mitochondria is the",
    "Once upon a time in a land",
    "import numpy as np\n",
    "The history of the Roman empire begins with",
]


def sides(llm: LLM, compare: str) -> dict[str, contextlib.AbstractContextManager]:
    """The two sides as context managers that set the choice while they are entered."""
    if compare == "rows":
        marked = qkernel.decode_step

        @contextlib.contextmanager
        def unmarked():  # the runner's marking left out: 2+ rows keep float32 x
            qkernel.decode_step = lambda active=True: contextlib.nullcontext()
            try:
                yield
            finally:
                qkernel.decode_step = marked

        return {"int8 x every row": contextlib.nullcontext, "int8 x at 1 row": unmarked}
    if compare == "c_rows":
        served, epilogue = qkernel.rows_served, QuantProduct.with_epilogue

        @contextlib.contextmanager
        def in_torch():  # the norms, attention and epilogues as torch's operators
            qkernel.rows_served = lambda: False
            QuantProduct.with_epilogue = lambda *args: None
            try:
                yield
            finally:
                qkernel.rows_served, QuantProduct.with_epilogue = served, epilogue

        return {"rows in C": contextlib.nullcontext, "rows in torch": in_torch}
    if compare == "blocks_rows":
        return blocks_rows_sides(llm)
    lm_head = llm.engine.runner.model.lm_head.quant
    blocks = lm_head.parts
    if not (len(blocks) == 1 and isinstance(blocks[0], BlocksPart)):
        raise SystemExit(f"the lm_head is {lm_head.describe()}, not a file's blocks: nothing to compare")
    dense = [DensePart(blocks[0].dequantize().to(llm.engine.runner.model.norm.weight.dtype))]

    @contextlib.contextmanager
    def held(parts):
        lm_head.parts = parts
        try:
            yield
        finally:
            lm_head.parts = blocks

    return {
        "lm_head blocks": lambda: held(blocks),
        f"lm_head dense {dense[0].weight.dtype}": lambda: held(dense),
    }


# The rows from which Q4_K's and Q6_K's products took the AMX blocks before session 49 (now 6).
OLD_BF16_MIN_ROWS = {"Q4_K": 12, "Q6_K": 8}


def blocks_rows_sides(llm: LLM) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """`--compare blocks_rows`: the served thresholds against the old ones (`OLD_BF16_MIN_ROWS`),
    set on every Q4_K and Q6_K part of the model while a side runs."""
    parts = [
        part
        for m in llm.engine.runner.model.modules()
        if isinstance(m, Linear) and m.quant is not None
        for part in m.quant.parts
        if isinstance(part, BlocksPart) and part.qtype in OLD_BF16_MIN_ROWS
    ]
    if not parts:
        raise SystemExit("no Q4_K or Q6_K blocks in this model: nothing to compare")

    @contextlib.contextmanager
    def old_thresholds():
        served = [(part.format, part.few_rows) for part in parts]
        for part in parts:
            part.format = dataclasses.replace(part.format, bf16_min_rows=OLD_BF16_MIN_ROWS[part.qtype])
            part.few_rows = min(part.format.min_rows, part.format.bf16_min_rows)
        try:
            yield
        finally:
            for part, (fmt, few) in zip(parts, served, strict=True):
                part.format, part.few_rows = fmt, few

    return {"blocks from 6 rows": contextlib.nullcontext, "old thresholds (12 / 8 rows)": old_thresholds}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compare", choices=("rows", "lm_head", "c_rows", "blocks_rows"), required=True)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--sequences", type=int, default=5, choices=range(1, len(PROMPTS) + 1))
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="the engine's dtype (auto: bfloat16 on CPUs that multiply it natively)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        weights="native",
        int8_activations=args.compare in ("rows", "blocks_rows"),
        kv_cache_tokens=4096,
        enable_chunk_cache=False,
    )
    ids = [llm.tokenizer.encode(t, add_special_tokens=False) for t in PROMPTS[: args.sequences]]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0, max_tokens=args.tokens + 1, ignore_eos=True)
    choices = sides(llm, args.compare)
    ms: dict[str, list[float]] = {name: [] for name in choices}
    tokens: dict[str, list[list[int]]] = {}
    for r in tqdm(range(args.rounds), desc="rounds"):
        for name in list(choices) if r % 2 == 0 else list(choices)[::-1]:
            with choices[name]():
                start = time.process_time()
                llm.generate(ids, one)
                first = time.process_time() - start
                start = time.process_time()
                outs = llm.generate(ids, many)
                ms[name].append((time.process_time() - start - first) / args.tokens * 1e3)
            tokens[name] = [o.outputs[0].token_ids for o in outs]
    (a, b) = choices
    for name in choices:
        print(
            f"{name}: {' '.join(f'{t:.1f}' for t in ms[name])} ms a step, median {statistics.median(ms[name]):.1f}"
        )
    same = sum(x == y for x, y in zip(tokens[a], tokens[b], strict=True))
    print(
        f"SUMMARY bench_decode_forms: compare={args.compare} model={args.model} sequences={args.sequences} "
        f"tokens={args.tokens} rounds={args.rounds} new_ms={statistics.median(ms[a]):.1f} "
        f"old_ms={statistics.median(ms[b]):.1f} speedup={statistics.median(ms[b]) / statistics.median(ms[a]):.2f}x "
        f"same_tokens={same}/{args.sequences}"
    )


if __name__ == "__main__":
    main()
