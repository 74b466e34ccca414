"""Reuse without separators: LangChain "stuff" prompts, documents reordered and recombined.

The prompt is what LangChain's "stuff" chain writes: every document through its document prompt
(`PromptTemplate.from_template("{page_content}")`, LangChain's default), joined by blank lines, and
put into LangChain's question-answering prompt (a `langchain_core` PromptTemplate) as one user
message, rendered by the model's chat template. No separators: the engine finds the documents
by separator-free matching (chunk/matcher.py) after seeing them in another order and combination.

Document tokens "matched" are those inside the documents that the engine borrows from the cache
(what is lost is the edges: tokens that tokenize differently next to their neighbours, and runs
shorter than separator_free_min_tokens); "served" is the engine's own count after blend chose what
to recompute (num_chunk_cached_tokens).

Part 1, reuse and TTFT: documents of ~1,000 tokens (each several `mendeleev` element texts). Per
trial, a first prompt holds five documents (first sight: the engine learns them); the timed prompt
holds four of them in another order with another question (second sight). Reported: the share of
the timed prompt's document tokens matched in the cache (before blend picks what to recompute)
and served from it (after), and the warm TTFT against a plain prefill of the same prompt, one
thread, the two interleaved (their order alternates; the plain prefills on a second engine with
prefix caching off, so that neither run finds the other's blocks); also the first sight's TTFT
against plain.

A third sight (the same four documents in another order, another question) is timed the same
way: under `--chunk-layout fusion` the second sight computes after S the documents it found only as
slices of the span (fusion borrows only exact KV), and the third borrows them.

Part 2, accuracy: fidelity questions (`fidelity_set`) asked in the stuff format with separator-free
reuse (after a warm-up prompt with the same documents reversed plus one more), against the
separator format of bench_fidelity with chunk reuse, both under the same reuse mode (the engine's:
`--chunk-layout`, else the model's default) and each with its own full prefill as reference; kept
counts the questions its full prefill answers that the reuse run answers too. The two formats run
on two engines, so neither finds the other's entries.

    python benchmarks/bench_separator_free.py --threads 1 [--questions 48] [--trials 3] [--chunk-layout fusion]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import fidelity_set
from bench_fidelity import SEP, SYSTEM
from bench_fidelity import render as render_separated
from langchain_core.documents import Document
from langchain_core.prompts import PromptTemplate, format_document
from tqdm import tqdm

from chunkcache import LLM, SamplingParams
from chunkcache.chunk.parse import parse_chunked_prompt
from chunkcache.fidelity import measure

# LangChain's question-answering "stuff" prompt (langchain.chains.question_answering.stuff_prompt).
STUFF_TEMPLATE = """Use the following pieces of context to answer the question at the end. If you don't know the answer, just say that you don't know, don't try to make up an answer.

{context}

Question: {question}
Helpful Answer:"""
DOCUMENT_PROMPT = PromptTemplate.from_template("{page_content}")
QA_PROMPT = PromptTemplate.from_template(STUFF_TEMPLATE)
SF_ON = {"separator_free": True}
SF_OFF = {"separator_free": False}
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def render_stuff(llm: LLM, docs: list[str], question: str) -> str:
    context = "\n\n".join(format_document(Document(page_content=d), DOCUMENT_PROMPT) for d in docs)
    user = QA_PROMPT.format(context=context, question=question)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def run(llm: LLM, prompt: str, params: SamplingParams, options: dict[str, Any] | None) -> Any:
    return llm.generate([prompt], params, add_special_tokens=False, chunk_options=options)[0]


def timed(llm: LLM, prompt: str, options: dict[str, Any]) -> tuple[float, float, Any, float]:
    """(TTFT, the call's wall time, output, the call's CPU seconds): the call also waits for the
    background work the request started (canonical entries of the runs it borrowed from inside
    entries), after it. CPU time (this process, one torch thread) is what a loaded machine does
    not distort."""
    t, c = time.perf_counter(), time.process_time()
    out = run(llm, prompt, FIRST_TOKEN, options)
    return out.metrics.ttft, time.perf_counter() - t, out, time.process_time() - c


def doc_tokens(llm: LLM, docs: list[str]) -> int:
    return sum(len(llm.tokenizer.encode(d, add_special_tokens=False)) for d in docs)


def coverage(llm: LLM, text: str, docs: list[str]) -> tuple[int, int]:
    """(document tokens the engine will borrow from the cache, document tokens) of a prompt about
    to run: its cut is planned on the current index, as the engine's admission will plan it, and
    only tokens inside the documents count (runs also cover the blank lines between them)."""
    engine = llm.engine
    assert engine.chunks is not None
    enc = llm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    config = engine.config.chunk
    cut = engine.chunks.cutter.plan(enc["input_ids"], config)
    covered = set()
    for a, b, run in cut.parts if cut is not None else ():
        if run is not None:
            covered.update(range(a, b))
    hit = total = at = 0
    for d in docs:
        start = text.index(d, at)
        at = start + len(d)
        inside = [i for i, (s, e) in enumerate(enc["offset_mapping"]) if s >= start and e <= at]
        total += len(inside)
        hit += sum(i in covered for i in inside)
    return hit, total


def long_documents(llm: LLM, elements: dict[int, fidelity_set.Element], n: int, tokens: int) -> list[str]:
    """`n` documents of about `tokens` tokens, each consecutive elements' texts."""
    docs, current = [], []
    for number in sorted(elements):
        current.append(elements[number].document())
        if doc_tokens(llm, ["".join(current)]) >= tokens:
            docs.append("".join(current).strip())
            current = []
            if len(docs) == n:
                break
    return docs


def reuse_and_ttft(
    llm: LLM, llm_plain: LLM, elements: dict[int, fidelity_set.Element], trials: int
) -> dict[str, Any]:
    """`llm_plain`: the same model with prefix caching off, for the plain prefills (on `llm` the
    first sight, now a plain prefill itself, and the plain run would hit each other's blocks)."""
    docs = long_documents(llm, elements, 5 * trials, 1000)
    rows = []
    for t in tqdm(range(trials), desc="ttft trials"):
        mine = docs[5 * t : 5 * t + 5]
        first = render_stuff(llm, mine, "Which element is the lightest?")
        again_docs = [mine[3], mine[0], mine[4], mine[2]]  # a new order and combination
        again = render_stuff(llm, again_docs, "Which element was discovered first?")
        row: dict[str, Any] = {}
        # First sight, interleaved with a plain prefill of the same prompt (order alternating).
        for name in ["plain", "learn"] if t % 2 else ["learn", "plain"]:
            seconds, _, _, cpu = (
                timed(llm, first, SF_ON) if name == "learn" else timed(llm_plain, first, SF_OFF)
            )
            row[f"first_{name}_s"], row[f"first_{name}_cpu_s"] = seconds, cpu
        row["matched_tokens"], row["doc_tokens"] = coverage(llm, again, again_docs)
        for name in ["plain", "warm"] if t % 2 == 0 else ["warm", "plain"]:
            if name == "warm":
                before = llm.engine.chunk_cache_stats()["separator_free_canonical_tokens"]
                seconds, wall, out, cpu = timed(llm, again, SF_ON)
                row["served_tokens"] = out.num_chunk_cached_tokens
                row["prompt_tokens"] = len(out.prompt_token_ids)
                # What the canonical entries cost, after the request (the engine was idle).
                row["canonical_s"] = wall - seconds
                row["canonical_tokens"] = (
                    llm.engine.chunk_cache_stats()["separator_free_canonical_tokens"] - before
                )
            else:
                seconds, _, _, cpu = timed(llm_plain, again, SF_OFF)
            row[f"{name}_s"], row[f"{name}_cpu_s"] = seconds, cpu
        # Third sight, the same four in another order: under fusion the documents the second
        # sight computed after S (slices of the span were not exact) are borrowed now.
        third_docs = [mine[2], mine[4], mine[0], mine[3]]
        third = render_stuff(llm, third_docs, "Which element has the highest melting point?")
        row["third_doc_tokens"] = doc_tokens(llm, third_docs)
        for name in ["plain", "warm"] if t % 2 else ["warm", "plain"]:
            if name == "warm":
                seconds, _, out, cpu = timed(llm, third, SF_ON)
                row["third_served_tokens"] = out.num_chunk_cached_tokens
            else:
                seconds, _, _, cpu = timed(llm_plain, third, SF_OFF)
            row[f"third_{name}_s"], row[f"third_{name}_cpu_s"] = seconds, cpu
        rows.append(row)
    total = sum(r["doc_tokens"] for r in rows)
    third_total = sum(r["third_doc_tokens"] for r in rows)
    return {
        "rows": rows,
        "matched_share": sum(r["matched_tokens"] for r in rows) / total,
        "served_share": sum(r["served_tokens"] for r in rows) / total,
        "warm_speedup": sum(r["plain_s"] for r in rows) / sum(r["warm_s"] for r in rows),
        "third_served_share": sum(r["third_served_tokens"] for r in rows) / third_total,
        "third_speedup": sum(r["third_plain_s"] for r in rows) / sum(r["third_warm_s"] for r in rows),
        "warm_cpu_speedup": sum(r["plain_cpu_s"] for r in rows) / sum(r["warm_cpu_s"] for r in rows),
        "third_cpu_speedup": sum(r["third_plain_cpu_s"] for r in rows)
        / sum(r["third_warm_cpu_s"] for r in rows),
        "first_sight_ratio": sum(r["first_learn_s"] for r in rows) / sum(r["first_plain_s"] for r in rows),
        "canonical_vs_plain": sum(r["canonical_s"] for r in rows) / sum(r["plain_s"] for r in rows),
        "doc_tokens_mean": total / len(rows),
    }


def accuracy(
    llm_sep: LLM,
    llm_sf: LLM,
    questions: list[fidelity_set.Question],
    elements: dict[int, fidelity_set.Element],
    max_tokens: int,
    sights: int,
    progress: Path | None = None,
) -> dict[str, Any]:
    """`progress`: a file rewritten after every question with the replies so far (a long run cut
    short keeps them)."""
    answer = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids = sorted(elements)
    per: dict[str, dict[str, Any]] = {}
    for i, q in enumerate(tqdm(questions, desc="questions", unit="q")):
        docs = [elements[n].document() for n in q.doc_ids]
        sep_text = render_separated(llm_sep, docs, q.question)
        parsed = parse_chunked_prompt(sep_text, SEP, llm_sep.tokenizer, add_special_tokens=False)
        assert parsed is not None
        # Separator format: the pool warmed as bench_fidelity warms it, then reuse (blend@0.15).
        run(llm_sep, sep_text, FIRST_TOKEN, {"chunk_layout": "isolated"})
        sep_reuse = run(llm_sep, sep_text, answer, None)
        sep_full = llm_sep.generate([parsed.all_token_ids()], answer, chunk_options=SF_OFF)[0]
        # Stuff format: first seen reversed with one more document and another question (the
        # engine learns the span), then seen again rotated (second sight: it borrows slices of
        # the span, and their canonical entries are computed after it), then asked in its own
        # order (third sight: it borrows the canonical entries). Both sights' answers are scored.
        extra = elements[ids[(q.doc_ids[0] * 7 + i) % len(ids)]].document()
        warm_docs = [extra, *reversed(docs)] if extra not in docs else list(reversed(docs))
        run(llm_sf, render_stuff(llm_sf, warm_docs, "What are these elements used for?"), FIRST_TOKEN, SF_ON)
        replies = {}
        if sights == 3:
            second = render_stuff(llm_sf, docs[1:] + docs[:1], q.question)
            replies["stuff_reuse_second_rotated"] = run(llm_sf, second, answer, SF_ON).outputs[0].text
        stuff_text = render_stuff(llm_sf, docs, q.question)
        matched, total = coverage(llm_sf, stuff_text, docs)
        sf_reuse = run(llm_sf, stuff_text, answer, SF_ON)
        sf_full = run(llm_sf, stuff_text, answer, SF_OFF)
        replies |= {
            "sep_full": sep_full.outputs[0].text,
            "sep_reuse": sep_reuse.outputs[0].text,
            "stuff_full": sf_full.outputs[0].text,
            "stuff_reuse": sf_reuse.outputs[0].text,
        }
        per[q.qid] = {
            "replies": replies,
            "correct": {k: fidelity_set.correct(v, q.answers) for k, v in replies.items()},
            "matched_share": matched / total,
        }
        if progress is not None:
            progress.write_text(json.dumps(per, indent=1))
    n = len(per)
    acc = {k: sum(p["correct"][k] for p in per.values()) / n for k in next(iter(per.values()))["correct"]}
    # Kept: of the questions its own format's full prefill answers, those the reuse run answers too
    # (accuracy alone hides answers lost on some questions and gained on others).
    kept = {}
    for k in acc:
        if "reuse" in k:
            full = "sep_full" if k.startswith("sep") else "stuff_full"
            both = sum(p["correct"][k] and p["correct"][full] for p in per.values())
            kept[k] = [both, sum(p["correct"][full] for p in per.values())]
    return {
        "questions": n,
        "sights": sights,
        "accuracy": acc,
        "kept": kept,
        "matched_share": sum(p["matched_share"] for p in per.values()) / n,
        "per_question": per,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint (default: chunkcache's default model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trials", type=int, default=3, help="TTFT trials (0: skip part 1)")
    parser.add_argument("--questions", type=int, default=48, help="fidelity questions (0: skip part 2)")
    parser.add_argument("--split", choices=["all", "tune", "heldout"], default="heldout")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument(
        "--sights",
        type=int,
        choices=[2, 3],
        default=3,
        help="accuracy: the stuff prompt is asked at its documents' second or third sight",
    )
    parser.add_argument(
        "--chunk-layout",
        choices=["offset", "fusion"],
        default=None,
        help="the engines' layout (default: the model's own); fusion: its default rule, no pair stream",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "separator_free.json")
    args = parser.parse_args(argv)
    if args.model is None:
        from chunkcache.model.loader import model_path

        args.model = str(model_path("smollm2"))
    elements = fidelity_set.load_elements()
    options: dict[str, Any] = {
        "device": "cpu",
        "dtype": "float32",
        "threads": args.threads,
        "kv_cache_tokens": 16384,
        # A later sight of an order would read the exact prefix its first sight's plain prefill
        # left (engine/follow_ups.py) and measure the prefix cache, not separator-free matching.
        **measure.ENGINE_OPTIONS,
    }
    if args.chunk_layout is not None:
        options["chunk_layout"] = args.chunk_layout
        if args.chunk_layout == "fusion":
            options["fusion_pair"] = "none"
    llm_sf = LLM(args.model, **options)
    result: dict[str, Any] = {"model": args.model, "threads": args.threads, "chunk_layout": args.chunk_layout}
    t0 = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.trials:
        llm_plain = LLM(args.model, **options, enable_prefix_caching=False)
        result["reuse_ttft"] = reuse_and_ttft(llm_sf, llm_plain, elements, args.trials)
        llm_plain.engine.close()
        del llm_plain
        args.out.write_text(json.dumps(result, indent=1))
    if args.questions:
        questions = fidelity_set.load()
        if args.split != "all":
            questions = [q for q in questions if q.split == args.split]
        llm_sep = LLM(args.model, **options)
        result["accuracy"] = accuracy(
            llm_sep,
            llm_sf,
            questions[: args.questions],
            elements,
            args.max_tokens,
            args.sights,
            args.out.with_suffix(".progress.json"),
        )
    result["seconds"] = time.time() - t0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    summary = ["SUMMARY bench_separator_free:"]
    if "reuse_ttft" in result:
        r = result["reuse_ttft"]
        for row in r["rows"]:
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()})
        summary += [
            f"matched_share={r['matched_share']:.1%} served_share={r['served_share']:.1%} (target matched>=80%)",
            f"warm_vs_plain={r['warm_speedup']:.2f}x (target>=3) first_sight_vs_plain={r['first_sight_ratio']:.2f}x",
            f"canonical_after_warm_vs_plain={r['canonical_vs_plain']:.2f}x",
            f"third_sight: served_share={r['third_served_share']:.1%} warm_vs_plain={r['third_speedup']:.2f}x",
            f"cpu_warm_vs_plain: second={r['warm_cpu_speedup']:.2f}x third={r['third_cpu_speedup']:.2f}x",
            f"doc_tokens={r['doc_tokens_mean']:.0f}",
        ]
    if "accuracy" in result:
        a = result["accuracy"]
        acc = a["accuracy"]
        print(json.dumps(acc, indent=1))
        summary += [
            f"acc_stuff_reuse={acc['stuff_reuse']:.1%} acc_sep_reuse={acc['sep_reuse']:.1%}",
            f"(target within 1 point) acc_stuff_full={acc['stuff_full']:.1%} acc_sep_full={acc['sep_full']:.1%}",
            f"questions={a['questions']} sights={a['sights']} q_matched_share={a['matched_share']:.1%}",
        ]
        if "stuff_reuse_second_rotated" in acc:
            summary.append(f"acc_stuff_reuse_second_sight_rotated={acc['stuff_reuse_second_rotated']:.1%}")
        summary += [f"kept_{k}={kept}/{of}" for k, (kept, of) in a["kept"].items()]
    print(" ".join(summary))


if __name__ == "__main__":
    sys.exit(main())
