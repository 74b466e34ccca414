"""Answer quality under chunk reuse: exact match of the bundled demo models, mode by mode.

The held-out set is `chunkcache.demo.held_out_set(seed, n)` (default seed 20260, 500 questions;
training used other seeds): documents about invented entities and a question whose answer is in
one document (single-hop) or needs two (two-hop); the answer restates the fact sentence(s) word
for word ("Zorvak has 4120 people."). Prompts are
`format_prompt(system, docs, question)`, the chunked chat format the models were trained on;
greedy decoding; a hit is `exact_match` (the stripped output equals the answer).

Each variant (`model-block`: trained on full and chunk-isolated layouts; `model-full`: full causal
attention only) answers every question in each mode of `chunkcache.evaluate.default_modes`, one
engine per variant with the chunk cache on, the mode given per request (`chunk_options`):

* full: a plain causal prefill of the same tokens (S, the documents and Q concatenated): the reference;
* isolated: every document's KV computed alone after S (DESIGN.md §2), Q after them;
* offset: the isolated KV moved to its real position (K re-rotated), nothing recomputed;
* blend@r: offset plus the share r of document tokens with the largest K deviation at layer 1
  recomputed from there on (CacheBlend);
* boundary-k: offset with the first k tokens of every document recomputed (EPIC).

Every reuse mode runs warm: a first pass puts every document into the chunk pool. TTFT is the mean
`RequestOutput.metrics.ttft` of the first `--ttft-n` prompts sent one at a time (`max_tokens=1`).

    python benchmarks/bench_quality.py [--n 500] [--seed 20260] [--ttft-n 50] [--variants block full]
        [--ratios 0.05 0.15 0.3] [--boundary-tokens 4] [--check-layer 1] [--threads N] [--demo-dir DIR] [--quick] [--no-write]

Prints a table and `SUMMARY bench_quality: ...`; unless --quick/--no-write, writes the section
`## bench_quality` of `benchmarks/RESULTS.md` and the plot `benchmarks/quality.png` (exact match
against the recompute ratio, one line per variant).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common import describe_machine, setup_torch
from tqdm import tqdm

from chunkcache import LLM, SamplingParams
from chunkcache.chunk.parse import parse_chunked_prompt
from chunkcache.demo import VARIANTS, demo_model_path, exact_match, format_prompt, held_out_set
from chunkcache.demo.corpus import Example
from chunkcache.evaluate import Mode, default_modes

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
PLOT = HERE / "quality.png"
SECTION = "bench_quality"
GREEDY = SamplingParams(temperature=0, max_tokens=48)  # a two-hop answer is two sentences
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)


@dataclass
class Row:
    variant: str
    mode: str
    ratio: float | None  # share of document tokens recomputed (full = 1, isolated = None)
    hop1: float
    hop2: float
    overall: float
    ttft_ms: float


def _pct(hits: list[bool]) -> float:
    return 100.0 * sum(hits) / len(hits) if hits else float("nan")


def _ratio(mode: Mode) -> float | None:
    if mode.chunk_options is None:
        return 1.0
    if mode.chunk_options["chunk_layout"] == "isolated":
        return None
    if mode.chunk_options.get("blend_boundary_tokens"):
        return None
    return float(mode.chunk_options["blend_recompute_ratios"][0])


def run_variant(
    path: Path, variant: str, modes: list[Mode], examples: list[Example], ttft_n: int
) -> list[Row]:
    llm = LLM(str(path))
    prompts = [format_prompt(ex.system, ex.docs, ex.question) for ex in examples]
    separator = llm.engine.config.chunk.separator
    token_ids = []
    for p in prompts:
        parsed = parse_chunked_prompt(p, separator, llm.engine.tokenizer)
        assert parsed is not None
        token_ids.append(parsed.all_token_ids())
    llm.generate(prompts, FIRST_TOKEN)  # the warm-up pass: every document into the chunk pool
    rows = []
    for mode in tqdm(modes, desc=variant, unit="mode"):
        sources = token_ids if mode.chunk_options is None else prompts
        outputs = llm.generate(sources, GREEDY, chunk_options=mode.chunk_options)
        hits = {1: [], 2: []}
        for ex, out in zip(examples, outputs, strict=True):
            hits[ex.hops].append(exact_match(out.outputs[0].text, ex.answer))
        ttfts = [
            llm.generate(s, FIRST_TOKEN, chunk_options=mode.chunk_options)[0].metrics.ttft
            for s in sources[:ttft_n]
        ]
        rows.append(
            Row(
                variant,
                mode.name,
                _ratio(mode),
                _pct(hits[1]),
                _pct(hits[2]),
                _pct(hits[1] + hits[2]),
                1000 * statistics.fmean(t for t in ttfts if t is not None),
            )
        )
    stats = llm.chunk_cache_stats()
    if stats.get("blend_fallbacks"):
        print(f"warning: {stats['blend_fallbacks']} blend fallbacks in {variant}", file=sys.stderr)
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| variant | mode | single-hop EM | two-hop EM | all EM | mean TTFT (ms) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.variant} | {r.mode} | {r.hop1:.1f}% | {r.hop2:.1f}% | {r.overall:.1f}% | {r.ttft_ms:.1f} |"
        )
    return "\n".join(lines)


def summary_line(rows: list[Row]) -> str:
    parts = []
    for variant in dict.fromkeys(r.variant for r in rows):
        mine = {r.mode: r for r in rows if r.variant == variant}
        full = mine["full"]
        bits = [f"full={full.hop1:.1f}"]
        bits += [f"{m}={r.hop1 - full.hop1:+.1f}pt" for m, r in mine.items() if m != "full"]
        parts.append(f"{variant}: " + " ".join(bits))
    return "SUMMARY bench_quality: single-hop EM% (reuse modes as points vs full) " + " | ".join(parts)


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, variant in enumerate(dict.fromkeys(r.variant for r in rows)):
        curve = sorted((r.ratio, r.overall) for r in rows if r.variant == variant and r.ratio is not None)
        line = ax.plot([x for x, _ in curve], [y for _, y in curve], marker="o", label=f"model-{variant}")[0]
        for r in rows:
            if r.variant == variant and r.mode == "isolated":
                ax.axhline(r.overall, color=line.get_color(), ls=":", lw=1)
                ax.annotate(f"isolated ({variant})", (0.55, r.overall), color=line.get_color(),
                            fontsize=8, xytext=(0, 3 - 12 * i), textcoords="offset points")  # fmt: skip
    ax.set_xlabel("share of document tokens recomputed (0 = offset reuse, 1 = full prefill)")
    ax.set_ylabel("exact match, all questions (%)")
    ax.set_title("Demo models: answer accuracy under chunk reuse")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_results(section_body: str) -> None:
    """Replace (or append) `## bench_quality` in RESULTS.md, re-reading the file just before."""
    heading = f"## {SECTION}"
    text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
    block = f"{heading}\n\n{section_body.strip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}[ \t]*\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: block + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + block
    RESULTS.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=500, help="held-out questions (default %(default)s)")
    p.add_argument("--seed", type=int, default=20260, help="held-out set seed (default %(default)s)")
    p.add_argument("--ttft-n", type=int, default=50, help="prompts timed one at a time (default %(default)s)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--ratios", nargs="+", type=float, default=[0.05, 0.15, 0.3])
    p.add_argument("--boundary-tokens", type=int, default=4)
    p.add_argument("--check-layer", type=int, default=1, help="blend's check layer (default %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--demo-dir", type=Path, default=None, help="a folder with model-block/ and model-full/")
    p.add_argument("--quick", action="store_true", help="40 questions, 5 timed: a smoke run")
    p.add_argument("--no-write", action="store_true", help="write neither RESULTS.md nor the plot")
    args = p.parse_args(argv)
    setup_torch(args.threads)
    if args.quick:
        args.n, args.ttft_n = 40, 5
    examples = held_out_set(args.seed, args.n)
    n2 = sum(ex.hops == 2 for ex in examples)
    print(f"{describe_machine()}\nheld-out set: seed {args.seed}, {args.n} questions ({n2} two-hop)")
    modes = default_modes(args.ratios, args.boundary_tokens, args.check_layer)
    rows: list[Row] = []
    t0 = time.perf_counter()
    for variant in args.variants:
        path = demo_model_path(variant) if args.demo_dir is None else args.demo_dir / f"model-{variant}"
        if not (path / "config.json").is_file():
            p.error(
                f"no checkpoint at {path}: train one with "
                "`python scripts/train_demo_model.py --out-dir chunkcache/demo` or pass --demo-dir"
            )
        rows += run_variant(path, variant, modes, examples, min(args.ttft_n, args.n))
    out, line = table(rows), summary_line(rows)
    print(f"\n{out}\n{line}\n({time.perf_counter() - t0:.0f} s)")
    if not (args.no_write or args.quick):
        plot(rows, PLOT)
        command = "python benchmarks/bench_quality.py" + ("" if argv is None else " " + " ".join(argv))
        if argv is None and sys.argv[1:]:
            command += " " + " ".join(sys.argv[1:])
        body = (
            f"`{command}`\n\n{describe_machine()}. Held-out set: seed {args.seed}, {args.n} questions "
            f"({args.n - n2} single-hop, {n2} two-hop); greedy, exact match; reuse modes warm; TTFT: "
            f"mean over {min(args.ttft_n, args.n)} requests sent one at a time. Plot: `benchmarks/{PLOT.name}`."
            f"\n\n{out}\n\n```\n{line}\n```"
        )
        write_results(body)
        print(f"wrote section '## {SECTION}' of {RESULTS} and {PLOT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
