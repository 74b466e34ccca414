"""Real-shape RAG (issue 56): answers kept, TTFT, decode and memory on N long, alike documents.

The questions are the frozen set of rag_shape_set.py (chunkcache/data/rag_shape_questions.json:
element documents from the `mendeleev` package, asked facts counterfactual; types one / two /
three / free; tune and held-out halves, frozen before any mode ran). A cell is N documents per
prompt (4, 8, 16) of a size (~300, ~500, ~1,000 tokens); `--questions K` takes the first K of each
type in the split. Each question is rendered as bench_fidelity renders its prompts (system turn,
then `SEP doc1 ... SEP docN SEP question`, the model's chat template) and run, one request at a
time on one in-process engine (`exact_follow_ups` off, fidelity.measure.ENGINE_OPTIONS), by:

- closed: the question alone, no documents (what the model answers from memory);
- full: no reuse, the chunked prompt's token ids as a plain prompt (bench_fidelity's full prefill);
- default: the chunked prompt with the model's catalog defaults (no chunk options);
- any mode of bench_fidelity's MODES (fusion/contrastive, fusion/contrastive/pairlead/m0.6, ...).

Per mode and question, in this order: TTFT cold (a one-token request under a fresh cache salt: the
documents never seen; on every --cold-every-th question), a one-token request over the same
documents in reverse order (the pool warm, the prompt new), then the answer (greedy, --max-tokens;
--max-tokens-free for free-form), whose own TTFT is the warm TTFT. Full prefill's one request
gives its reply and its TTFT (cold and warm alike: nothing is reused but what the cell's earlier
questions left in the prefix cache, the system part); closed is not timed. Every request but the
cold and closed ones runs under the cell's cache salt: the smaller documents are prefixes of the
larger, and a cell must not find another cell's prompts in the prefix cache. Decode: ms per token
from the answer's first token to its last. Memory per request: the peak over the answer's engine
steps of the paged KV blocks held (referenced) by running sequences (a fusion request's streams, an
offset request's blended prompt, a full prefill's prompt), and of the chunk pool's pages pinned by
running requests (the documents' KV the streams read; shared with other requests, counted whole),
in bytes.

Answers are checked by rag_shape.score's rules (numbers as the document writes them or rounded
keeping 3 significant digits; the first named choice; the first count). Per cell, type and mode:
correct, kept / lost / gained against full, replies from memory, for free-form the share of the
expected facts stated, of full's stated facts kept, and agreement with full (the same facts stated);
TTFT cold / warm (ms, and full's over the mode's: the speedup), decode ms per token and its ratio
to full's, peak KV and pool MB and the ratio of their sum to full's KV. Raw results go to --raw
(JSON, rewritten after every request group; a rerun skips what is there), plots to --plot (answers
kept and warm TTFT speedup against N), one SUMMARY line.

    python benchmarks/bench_rag_shape.py --model smollm2 --n 4 --size 300 --questions 2 \\
        --modes default --raw rag.json --plot rag.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from itertools import count
from pathlib import Path
from typing import Any

import common
from bench_fidelity import CLOSED, MODES, render_closed
from rag_shape_set import WORDING_HELP, WORDINGS, worded
from tqdm import tqdm

from chunkcache import LLM, SamplingParams
from chunkcache.errors import InvalidRequestError
from chunkcache.fidelity import measure
from chunkcache.fidelity import rag_shape as rs

FULL, DEFAULT = "full", "default"
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)
_IDS = count()


@dataclass
class Run:
    """One request: its reply, wall TTFT (s), decode (tokens after the first, seconds), and the
    peak paged KV / pinned pool bytes while it ran."""

    reply: str
    ttft: float
    decode: tuple[int, float]
    kv_bytes: int
    pool_bytes: int


def _held(llm: LLM) -> tuple[int, int]:
    """(paged KV blocks referenced, chunk pool pages pinned) right now."""
    engine = llm.engine
    blocks = engine.blocks.num_blocks - engine.blocks.num_free_blocks
    pool = engine.chunks.pool if engine.chunks is not None else None
    pinned = sum(len(e.pages) for e in pool.entries() if e.pins) if pool is not None else 0
    return blocks, pinned


def _block_bytes(llm: LLM) -> int:
    engine = llm.engine
    size = engine.runner.kv_caches[0][0].element_size()  # (K, V) per layer
    return engine.spec.kv_bytes_per_token(size) * engine.blocks.block_size


def request(
    llm: LLM, prompt: str | list[int], params: SamplingParams, options: Any, salt: str | None = None
) -> Run:
    """One request on the otherwise idle engine, its memory sampled after every step."""
    engine, rid = llm.engine, f"rag-{next(_IDS)}"
    base_blocks, base_pages = _held(llm)
    peak_blocks = peak_pages = 0
    first = final = None
    start = time.perf_counter()
    engine.add_request(rid, prompt, params, add_special_tokens=False, chunk_options=options, cache_salt=salt)
    while engine.has_unfinished_requests() or engine.has_background_work():
        for out in engine.step():
            if out.request_id == rid and first is None and out.outputs[0].token_ids:
                first = time.perf_counter()
            if out.request_id == rid and out.finished:
                final = out
        if final is None:
            blocks, pages = _held(llm)
            peak_blocks, peak_pages = (
                max(peak_blocks, blocks - base_blocks),
                max(peak_pages, pages - base_pages),
            )
    assert final is not None and first is not None
    m, unit = final.metrics, _block_bytes(llm)
    decode = (len(final.outputs[0].token_ids) - 1, (m.finished_time or 0.0) - (m.first_token_time or 0.0))
    return Run(final.outputs[0].text, first - start, decode, peak_blocks * unit, peak_pages * unit)


@dataclass(frozen=True)
class Prompts:
    text: str  # the chunked prompt
    reversed_text: str  # the same documents in reverse order: warms the pool, not the prompt
    full_ids: list[int]
    closed_ids: list[int]
    # The cell's cache salt: the smaller documents are prefixes of the larger, so that without it
    # one cell's full prefill would find another's first document in the prefix cache.
    salt: str


def prompts(llm: LLM, q: rs.RagQuestion, records: dict[int, rs.Record], size: int) -> Prompts:
    sep = llm.engine.config.chunk.separator
    docs = q.documents(records, size)
    text = measure.render(llm.tokenizer, docs, q.question, sep)
    full_ids = measure.parse(llm, text).all_token_ids()
    reverse = measure.render(llm.tokenizer, docs[::-1], q.question, sep)
    salt = f"cell/{q.n}x{size}"
    return Prompts(text, reverse, full_ids, render_closed(llm.tokenizer, q.question), salt)


def run_mode(llm: LLM, mode: str, p: Prompts, params: SamplingParams, cold: str | None) -> dict[str, Any]:
    """The mode's answer and its TTFTs as a raw record. The answer request's own TTFT is the warm
    one (full prefill: its only one); `cold`: a cache salt under which to time a cold request."""
    if mode == CLOSED:
        return {"run": asdict(request(llm, p.closed_ids, params, None))}
    if mode == FULL:
        run = request(llm, p.full_ids, params, None, salt=p.salt)
        return {"run": asdict(run), "ttft_cold": run.ttft}
    options = None if mode == DEFAULT else MODES[mode]
    record = {}
    if cold is not None:
        record["ttft_cold"] = request(llm, p.text, ONE_TOKEN, options, salt=cold).ttft
    request(llm, p.reversed_text, ONE_TOKEN, options, salt=p.salt)  # the pool warm, not the prompt
    return {**record, "run": asdict(request(llm, p.text, params, options, salt=p.salt))}


def select(questions: list[rs.RagQuestion], n: int, split: str, k: int) -> list[rs.RagQuestion]:
    """The first k of each type with N documents in the split, types interleaved."""
    by_kind: dict[str, list[rs.RagQuestion]] = {kind: [] for kind in rs.KINDS}
    for q in questions:
        if q.n == n and q.split == split and len(by_kind[q.kind]) < k:
            by_kind[q.kind].append(q)
    return [qs[i] for i in range(k) for qs in by_kind.values() if i < len(qs)]


def load_raw(path: Path | None) -> dict[str, Any]:
    return json.loads(path.read_text()) if path is not None and path.exists() else {}


def save_raw(path: Path | None, raw: dict[str, Any]) -> None:
    if path is not None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(raw, indent=0))
        os.replace(tmp, path)


def measure_all(llm: LLM, args: argparse.Namespace, cells: list, raw: dict[str, Any]) -> None:
    """Every (cell, question, mode) not in `raw` yet, modes in a rotating order per question."""
    records = rs.load_records()
    todo = [(n, s, q) for n, s, qs in cells for q in qs]
    bar = tqdm(total=len(todo) * len(args.modes), desc="requests", unit="mode")
    for i, (n, size, q) in enumerate(todo):
        keys = {mode: f"{n}x{size}/{q.qid}/{mode}" for mode in args.modes}
        missing = [m for m in args.modes if keys[m] not in raw]
        bar.update(len(args.modes) - len(missing))
        if not missing:
            continue
        try:
            p = prompts(llm, q, records, size)
        except InvalidRequestError as e:
            print(f"{n}x{size}/{q.qid}: {e}", file=sys.stderr)
            bar.update(len(missing))
            continue
        tokens = args.max_tokens_free if q.kind == "free" else args.max_tokens
        params = SamplingParams(temperature=0, max_tokens=tokens)
        k = i % len(missing)
        for mode in missing[k:] + missing[:k]:
            cold = args.cold_every > 0 and i % args.cold_every == 0
            raw[keys[mode]] = run_one(llm, mode, p, params, keys[mode] if cold else None, q)
            save_raw(args.raw, raw)
            bar.update(1)
    bar.close()


def run_one(
    llm: LLM, mode: str, p: Prompts, params: SamplingParams, key: str | None, q: rs.RagQuestion
) -> dict:
    try:
        record = run_mode(llm, mode, p, params, None if key is None else f"cold/{key}/{time.time()}")
    except InvalidRequestError as e:  # e.g. longer than the model's context
        return {"error": str(e), "prompt_tokens": len(p.full_ids)}
    return {**record, "prompt_tokens": len(p.full_ids), **score_record(q, record["run"]["reply"])}


def score_record(q: rs.RagQuestion, reply: str) -> dict[str, list[bool]]:
    return {"facts": rs.facts(q, reply), "memory": rs.facts(q, reply, q.memory)}


# ---- the report ---------------------------------------------------------------------------------


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def row(mode: str, qs: list[rs.RagQuestion], recs: dict[str, dict], full: dict[str, dict]) -> dict[str, Any]:
    """One mode's figures over questions `qs` (recs / full: qid -> raw record)."""
    ok = {q.qid: all(recs[q.qid]["facts"]) for q in qs}
    full_ok = {q.qid: all(full[q.qid]["facts"]) for q in qs}
    stated = sum(sum(recs[q.qid]["facts"]) for q in qs)
    full_facts = [(a, b) for q in qs for a, b in zip(recs[q.qid]["facts"], full[q.qid]["facts"], strict=True)]
    out: dict[str, Any] = {
        "mode": mode,
        "n": len(qs),
        "correct": sum(ok.values()),
        "full_correct": sum(full_ok.values()),
        "kept": sum(ok[i] and full_ok[i] for i in ok),
        "lost": sum(full_ok[i] and not ok[i] for i in ok),
        "gained": sum(ok[i] and not full_ok[i] for i in ok),
        "memory": sum(any(recs[q.qid]["memory"]) for q in qs),
        "facts": stated / max(1, sum(len(q.answers) for q in qs)),
        "facts_kept": _ratio(sum(a and b for a, b in full_facts), sum(b for _, b in full_facts)),
        "agree": sum(recs[q.qid]["facts"] == full[q.qid]["facts"] for q in qs),
        "same": sum(recs[q.qid]["run"]["reply"] == full[q.qid]["run"]["reply"] for q in qs),
    }
    out.update(costs(qs, recs, full))
    if mode == CLOSED:  # a prompt without the documents: its TTFT compares with nothing
        out.update({k: float("nan") for k in ("ttft_cold_ms", "cold_x", "ttft_warm_ms", "warm_x")})
    return out


def _ttft(recs: dict[str, dict], full: dict[str, dict], qs: list[rs.RagQuestion], cold: bool):
    """(mean ms, full's total over the mode's) over the questions the mode timed so."""

    def get(r: dict) -> float | None:
        return r.get("ttft_cold") if cold else r["run"]["ttft"]

    timed = [q.qid for q in qs if get(recs[q.qid]) is not None and get(full[q.qid]) is not None]
    mode_s = sum(get(recs[i]) for i in timed)
    return 1000 * mode_s / len(timed) if timed else float("nan"), _ratio(
        sum(get(full[i]) for i in timed), mode_s
    )


def costs(qs: list[rs.RagQuestion], recs: dict[str, dict], full: dict[str, dict]) -> dict[str, float]:
    def decode_ms(rs_: dict[str, dict]) -> float:
        steps = [rs_[q.qid]["run"]["decode"] for q in qs]
        return _ratio(1000 * sum(s for _, s in steps), sum(n for n, _ in steps))

    def mem(rs_: dict[str, dict]) -> float:
        return _mean([rs_[q.qid]["run"]["kv_bytes"] + rs_[q.qid]["run"]["pool_bytes"] for q in qs])

    cold_ms, cold_x = _ttft(recs, full, qs, cold=True)
    warm_ms, warm_x = _ttft(recs, full, qs, cold=False)
    return {
        "ttft_cold_ms": cold_ms,
        "cold_x": cold_x,
        "ttft_warm_ms": warm_ms,
        "warm_x": warm_x,
        "decode_ms": decode_ms(recs),
        "decode_vs_full": _ratio(decode_ms(recs), decode_ms(full)),
        "kv_mb": _mean([recs[q.qid]["run"]["kv_bytes"] for q in qs]) / 2**20,
        "pool_mb": _mean([recs[q.qid]["run"]["pool_bytes"] for q in qs]) / 2**20,
        "mem_vs_full": _ratio(mem(recs), mem(full)),
        "prompt_tokens": _mean([recs[q.qid]["prompt_tokens"] for q in qs]),
    }


def cell_rows(raw: dict[str, Any], cell: str, qs: list[rs.RagQuestion], modes: list[str]) -> list[dict]:
    """Rows per type (and "all") and mode, over the questions every mode answered."""
    recs = {m: {q.qid: raw.get(f"{cell}/{q.qid}/{m}") for q in qs} for m in modes}
    done = [q for q in qs if all(r[q.qid] and "error" not in r[q.qid] for r in recs.values())]
    for q in done:  # scored again: the rules as they are now, whatever run wrote the file
        for r in recs.values():
            r[q.qid] = {**r[q.qid], **score_record(q, r[q.qid]["run"]["reply"])}
    rows = []
    for kind in (*rs.KINDS, "all"):
        part = [q for q in done if kind in (q.kind, "all")]
        if part:
            rows += [{"cell": cell, "type": kind, **row(m, part, recs[m], recs[FULL])} for m in modes]
    return rows


_COLUMNS = (
    ("type", "{:<6}"), ("mode", "{:<34}"), ("n", "{:>3}"), ("correct", "{:>4}"), ("kept", "{:>4}"),
    ("lost", "{:>4}"), ("gained", "{:>4}"), ("memory", "{:>4}"), ("facts", "{:>6.2f}"),
    ("facts_kept", "{:>6.2f}"), ("agree", "{:>4}"), ("ttft_cold_ms", "{:>9.0f}"), ("cold_x", "{:>7.2f}"),
    ("ttft_warm_ms", "{:>9.0f}"), ("warm_x", "{:>7.2f}"), ("decode_ms", "{:>7.1f}"),
    ("decode_vs_full", "{:>6.2f}"), ("kv_mb", "{:>7.1f}"), ("pool_mb", "{:>7.1f}"), ("mem_vs_full", "{:>6.2f}"),
)  # fmt: skip
_HEADS = "type  mode                                 n  ok kept lost gain  mem  facts fkept agr   cold ms cold x   warm ms warm x  dec ms dec/f   KV MB pool MB mem/f"


def print_rows(rows: list[dict]) -> None:
    print(_HEADS)
    for r in rows:
        print("".join(fmt.format(r[key]) for key, fmt in _COLUMNS))


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (kept_ax, ttft_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    lines: dict[tuple[str, str], list[tuple[int, float, float]]] = defaultdict(list)
    for r in rows:
        if r["type"] == "all" and r["mode"] not in (FULL, CLOSED):
            n, size = (int(x) for x in r["cell"].split("x"))
            lines[(r["mode"], f"~{size}")].append((n, _ratio(r["kept"], r["full_correct"]), r["warm_x"]))
    for (mode, size), points in sorted(lines.items()):
        points.sort()
        xs = [p[0] for p in points]
        kept_ax.plot(xs, [100 * p[1] for p in points], "o-", label=f"{mode} {size}")
        ttft_ax.plot(xs, [p[2] for p in points], "o-", label=f"{mode} {size}")
    kept_ax.set(xlabel="documents per prompt (N)", ylabel="full prefill's correct answers kept (%)")
    ttft_ax.set(xlabel="documents per prompt (N)", ylabel="warm TTFT speedup over full prefill (x)")
    ns = sorted({p[0] for points in lines.values() for p in points})
    kept_ax.set_ylim(0, 105)
    ttft_ax.set_ylim(bottom=0)
    for ax in (kept_ax, ttft_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary_line(rows: list[dict]) -> str:
    items = {}
    for r in rows:
        if r["type"] != "all":
            continue
        key = f"{r['mode']}@{r['cell']}"
        if r["mode"] == FULL or r["mode"] == CLOSED:
            items[key] = f"{r['correct']}/{r['n']}"
        else:
            items[key] = (
                f"kept{r['kept']}/{r['full_correct']},warm{r['warm_x']:.1f}x,mem{r['mem_vs_full']:.2f}"
            )
    return common.summary("bench_rag_shape", **items)


def refused(raw: dict[str, Any], cell: str, qs: list[rs.RagQuestion], modes: list[str]) -> str | None:
    """A line on the questions some mode could not run (e.g. full prefill beyond the model's
    context), with what the other modes answered there; None where every mode ran every one."""
    recs = {m: {q.qid: raw.get(f"{cell}/{q.qid}/{m}") for q in qs} for m in modes}
    hit = [q for q in qs if any(r[q.qid] and "error" in r[q.qid] for r in recs.values())]
    if not hit:
        return None
    why = {m: next(r[q.qid]["error"] for q in hit if r[q.qid] and "error" in r[q.qid]) for m, r in recs.items()
           if any(r[q.qid] and "error" in r[q.qid] for q in hit)}  # fmt: skip
    ran = {
        m: sum(
            all(score_record(q, r[q.qid]["run"]["reply"])["facts"])
            for q in hit
            if r[q.qid] and "run" in r[q.qid]
        )
        for m, r in recs.items()
        if m not in why
    }
    answered = ", ".join(f"{m} {c} correct" for m, c in ran.items())
    return f"{cell}: {len(hit)} questions refused by {why} (left out of the table); there: {answered}"


def report(raw: dict[str, Any], cells: list, args: argparse.Namespace) -> None:
    rows = []
    for n, size, qs in cells:
        if note := refused(raw, f"{n}x{size}", qs, args.modes):
            print(note)
        cell_part = cell_rows(raw, f"{n}x{size}", qs, args.modes)
        if cell_part:
            print(
                f"\n=== N={n} x ~{size} tokens, {args.split}, {cell_part[0]['prompt_tokens']:.0f} prompt tokens ==="
            )
            print_rows(cell_part)
        rows += cell_part
    if args.plot and rows:
        plot(rows, args.plot, f"bench_rag_shape: {Path(args.model).name}, {args.split}")
    print(summary_line(rows))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2", help="a short name (smollm2, default), a path")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weights", default=None, help="engine option `weights` (default: the model's)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n", type=int, nargs="+", default=[8], choices=(4, 8, 16))
    parser.add_argument("--size", type=int, nargs="+", default=[500], choices=rs.SIZES)
    parser.add_argument("--split", choices=("tune", "heldout"), default="tune")
    parser.add_argument("--wording", choices=WORDINGS, default="frozen", help=WORDING_HELP)
    parser.add_argument("--questions", type=int, default=4, help="per type and cell (at most 8)")
    parser.add_argument("--modes", nargs="+", default=[DEFAULT], help=f"{DEFAULT} or of {list(MODES)}")
    parser.add_argument(
        "--cold-every", type=int, default=1, help="time cold TTFT on every k-th question (0: never)"
    )
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-tokens-free", type=int, default=80, help="max tokens of free-form replies")
    parser.add_argument(
        "--raw", type=Path, default=None, help="raw results (JSON); a rerun skips what it holds"
    )
    parser.add_argument("--report-only", action="store_true", help="report on --raw, run nothing")
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    unknown = [m for m in args.modes if m not in (*MODES, DEFAULT)]
    if unknown:
        parser.error(f"unknown modes {unknown}")
    args.modes = list(dict.fromkeys([CLOSED, FULL, *args.modes]))
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    questions = worded(rs.load(), rs.load_records(), args.wording)
    cells = [(n, s, select(questions, n, args.split, args.questions)) for n in args.n for s in args.size]
    raw = load_raw(args.raw)
    if not args.report_only:
        args.model = common.bench_model(args)
        weights = {} if args.weights is None else {"weights": args.weights}
        llm = LLM(
            args.model,
            device="cpu",
            dtype=args.dtype,
            threads=args.threads,
            **weights,
            **measure.ENGINE_OPTIONS,
        )
        measure.check_engine(llm)
        t0 = time.time()
        measure_all(llm, args, cells, raw)
        print(f"model {args.model}, {time.time() - t0:.0f} s")
    report(raw, cells, args)


if __name__ == "__main__":
    sys.exit(main())
