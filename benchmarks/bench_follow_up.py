"""Follow-up questions over the same documents: a blend's KV found again in the prefix cache.

A RAG chat asks a second question over the documents of the first, in the same order. Each
question of `fidelity_set` (real encyclopedic texts from the `mendeleev` package, 3-5 per prompt)
gives a first question (its own) and a follow-up (another question about one of its documents),
both rendered with the chat template as bench_fidelity renders them. Three engines of the same
model, one thread each, in one process:
- plain: no chunk cache, prefix caching on: a follow-up finds S and every document in the prefix
  cache (exact) and computes only its question: the baseline at its best (llama.cpp's case too);
- blend: layout offset (blend@0.15, the defaults of a model the catalog does not know), prefix
  caching off: every request blends anew, as a chunked request did before its blocks were
  registered for follow-ups;
- chain: the same, prefix caching on (the default): the first question's blended blocks are
  registered under a key of its blend options and cuts, and the follow-up reads them, computing
  only its question and the last document's tokens after its last full block;
- exact: chain with `exact_follow_ups` (`--exact-sights`, default 1; at the engine's default 2 the
  follow-up queues the job instead, and only a third question would read it): after the first question a background job (run untimed
  here, as in a server's idle time) prefills S and the documents as a plain prompt, and the
  follow-up reads that exact KV: a full prefill's answer at a prefix-cache hit's cost;
- fusion: layout fusion with the model's own fusion options (both known models' default,
  model/catalog.py), prefix caching on: every request, follow-ups too, runs its streams;
- fusion_exact: fusion with `exact_follow_ups`: the first question is fusion's and queues the job
  (untimed, its CPU reported apart); the follow-up runs as one plain prompt over that exact KV.

Every document is in the chunk pools before the first question (an isolated request over the
first question's prompt, as bench_fidelity warms them), as in production. Per
doc set, untimed unless said: (1) the first question, timed (blend and chain both blend; chain
also runs the last document's tail fresh); (2) the follow-up, timed; then (3) both questions
answered (greedy, 24 tokens) on every engine. Timed runs are one-token requests, the engines'
order rotating per doc set; wall and process CPU time. Answers: accuracy of the follow-ups per
engine, and whether chain's replies equal those of a twin engine (chain's options) that never saw
the first question and blends the follow-up itself: they should, the same KV found or computed.
Blend's replies may differ where the last document's tail (run fresh under chain) tips them.

    python benchmarks/bench_follow_up.py --threads 1 [--sets 24] [--model smollm2] [--exact-sights 1]

Last line: `SUMMARY bench_follow_up: follow_chain_vs_blend=..x follow_chain_vs_plain=..x
first_chain_vs_blend=..x follow_exact_vs_blend=..x follow_fusion_exact_vs_fusion=..x cpu_...
same_replies=K/N exact_replies_as_full=K/N fusion_exact_replies_as_full=K/N`.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from pathlib import Path
from typing import Any

import fidelity_set
from bench_fidelity import SEP, render
from common import now, setup_torch, summary
from tqdm import tqdm

from chunkcache import LLM, SamplingParams
from chunkcache.chunk.parse import parse_chunked_prompt

ONE = SamplingParams(temperature=0, max_tokens=1)
_ids = itertools.count()
ANSWER = SamplingParams(temperature=0, max_tokens=24)


def follow_up(q: fidelity_set.Question, elements: dict[int, fidelity_set.Element]) -> tuple[str, list]:
    """Another question about one of q's documents: the first template not asked by q itself."""
    for number in q.doc_ids:
        for _, text, answers in fidelity_set._single(elements[number]):
            if text != q.question:
                return text, answers
    raise ValueError(f"no follow-up for {q.qid}")


def token_ids(llm: LLM, text: str) -> list[int]:
    parsed = parse_chunked_prompt(text, SEP, llm.tokenizer, add_special_tokens=False)
    assert parsed is not None
    return parsed.all_token_ids()


def timed(llm: LLM, prompt: str | list[int]) -> tuple[float, float, float]:
    """(wall, process CPU) seconds to the first token of a one-token request; the background work
    it queues (exact_follow_ups' job) then runs untimed, as in the idle time a server has: its
    process CPU seconds third."""
    engine = llm.engine
    request_id = f"timed-{next(_ids)}"
    start = now()
    engine.add_request(request_id, prompt, ONE, add_special_tokens=False)
    first: tuple[float, float] | None = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if first is None and out.request_id == request_id and out.outputs[0].token_ids:
                first = now()
    assert first is not None
    idle = now()
    while engine.has_background_work():
        engine.step()
    return first[0] - start[0], first[1] - start[1], now()[1] - idle[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint (default: chunkcache's default model)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sets", type=int, default=24, help="doc sets (first questions of the tune split)")
    parser.add_argument(
        "--exact-sights",
        type=int,
        default=1,
        help="exact_follow_ups_sights of the exact engines: 1, the first question queues the job; at "
        "2 (the engine's default) the follow-up is the order's second sight and queues it",
    )
    args = parser.parse_args(argv)
    setup_torch(args.threads)
    if args.model is None:
        from chunkcache.model.loader import model_path

        args.model = str(model_path("smollm2"))
    common: dict[str, Any] = {"device": "cpu", "dtype": "float32", "threads": args.threads}
    # Offset's blend at the engine's defaults (a known model's own layout is fusion, catalog.py).
    offset = {**common, "chunk_layout": "offset"}
    # exact_follow_ups is on by default: the engines measured without it say so.
    off = {"exact_follow_ups": False}
    on = {"exact_follow_ups": True, "exact_follow_ups_sights": args.exact_sights}
    engines = {
        "plain": LLM(args.model, enable_chunk_cache=False, **common),
        "blend": LLM(args.model, enable_prefix_caching=False, **offset, **off),
        "chain": LLM(args.model, **offset, **off),
        "exact": LLM(args.model, **offset, **on),
        "fusion": LLM(args.model, chunk_layout="fusion", **common, **off),
        "fusion_exact": LLM(args.model, chunk_layout="fusion", **common, **on),
    }
    # Chain's twin that never sees a first question: it blends every follow-up itself (the last
    # document's tail fresh, as chain's blend does), so its replies are what chain's must equal.
    check = LLM(args.model, **offset, **off)
    elements = fidelity_set.load_elements()
    questions = [q for q in fidelity_set.load() if q.split == "tune"][: args.sets]
    names = list(engines)
    first: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    follow: dict[str, list[tuple[float, float, float]]] = {n: [] for n in names}
    correct: dict[str, int] = dict.fromkeys(names, 0)
    same = same_as_blend = exact_as_plain = fusion_exact_as_plain = 0
    hits = 0  # timed follow-ups that read a blended prefix (chain)
    exact_hits = dict.fromkeys(("exact", "fusion_exact"), 0)  # ... or an exact one
    for i, q in enumerate(tqdm(questions, desc="doc sets", unit="set")):
        docs = [elements[n].document() for n in q.doc_ids]
        text2, answers2 = follow_up(q, elements)
        p1, p2 = (
            render(engines["plain"].tokenizer, docs, q.question),
            render(engines["plain"].tokenizer, docs, text2),
        )
        # Plain gets the chunked prompts' own token ids (each part tokenized alone): a full prefill
        # of exactly what the chunk engines read, as bench_fidelity's "full".
        prompts = {name: (p1, p2) for name in names}
        prompts["plain"] = (token_ids(engines["plain"], p1), token_ids(engines["plain"], p2))
        for llm in [*(engines[n] for n in names if n != "plain"), check]:  # seen before
            llm.generate([p1], ONE, add_special_tokens=False, chunk_options={"chunk_layout": "isolated"})
        rotation = names[i % len(names) :] + names[: i % len(names)]
        for name in rotation:
            first[name].append(timed(engines[name], prompts[name][0]))
        before = engines["chain"].chunk_cache_stats()["blended_prefix_hits"]
        exact_before = {n: engines[n].chunk_cache_stats()["exact_prefix_hits"] for n in exact_hits}
        for name in rotation:
            follow[name].append(timed(engines[name], prompts[name][1]))
        hits += engines["chain"].chunk_cache_stats()["blended_prefix_hits"] - before
        for n in exact_hits:
            exact_hits[n] += engines[n].chunk_cache_stats()["exact_prefix_hits"] - exact_before[n]
        replies = {}
        for name in names:
            out = engines[name].generate([prompts[name][1]], ANSWER, add_special_tokens=False)[0]
            replies[name] = out.outputs[0].text
            correct[name] += fidelity_set.correct(replies[name], answers2)
        alone = check.generate([p2], ANSWER, add_special_tokens=False)[0].outputs[0].text
        same += replies["chain"] == alone
        same_as_blend += replies["chain"] == replies["blend"]
        exact_as_plain += replies["exact"] == replies["plain"]
        fusion_exact_as_plain += replies["fusion_exact"] == replies["plain"]
    n = len(questions)
    print(
        f"\n{n} doc sets, model {Path(args.model).name}, {args.threads} thread(s); {len(prompts['plain'][1])} tokens in the last follow-up"
    )
    print(f"chain engine: {hits} timed follow-ups read a blended prefix (of {n})")
    print(
        f"{'':12} {'first wall ms':>14} {'first cpu ms':>13} {'job cpu ms':>11} {'follow wall ms':>15} "
        f"{'follow cpu ms':>14} {'follow-up correct':>18}"
    )
    for name in names:
        fw, fc, fb = (1000 * statistics.fmean(x[k] for x in first[name]) for k in (0, 1, 2))
        uw, uc = (1000 * statistics.fmean(x[k] for x in follow[name]) for k in (0, 1))
        print(f"{name:12} {fw:14.1f} {fc:13.1f} {fb:11.1f} {uw:15.1f} {uc:14.1f} {correct[name]:>12}/{n}")
    print(f"chain's follow-up replies equal those of its twin that blends them itself: {same}/{n}")
    print(f"chain's follow-up replies equal blend's (no fresh tail): {same_as_blend}/{n}")
    print(f"exact's follow-up replies equal plain's (a full prefill's): {exact_as_plain}/{n}")
    print(f"fusion_exact's follow-up replies equal plain's (a full prefill's): {fusion_exact_as_plain}/{n}")
    for name, count in exact_hits.items():
        print(f"{name} engine: {count} timed follow-ups read an exact prefix (of {n})")

    def ratio(side: dict[str, list[tuple[float, float, float]]], a: str, b: str, k: int) -> str:
        return f"{sum(x[k] for x in side[b]) / sum(x[k] for x in side[a]):.2f}x"

    print(
        summary(
            "bench_follow_up",
            follow_chain_vs_blend=ratio(follow, "chain", "blend", 0),
            follow_chain_vs_plain=ratio(follow, "chain", "plain", 0),
            first_chain_vs_blend=ratio(first, "chain", "blend", 0),
            follow_exact_vs_blend=ratio(follow, "exact", "blend", 0),
            follow_fusion_exact_vs_fusion=ratio(follow, "fusion_exact", "fusion", 0),
            follow_fusion_exact_vs_plain=ratio(follow, "fusion_exact", "plain", 0),
            cpu_follow_chain_vs_blend=ratio(follow, "chain", "blend", 1),
            cpu_follow_chain_vs_plain=ratio(follow, "chain", "plain", 1),
            cpu_first_chain_vs_blend=ratio(first, "chain", "blend", 1),
            cpu_follow_exact_vs_blend=ratio(follow, "exact", "blend", 1),
            cpu_follow_fusion_exact_vs_fusion=ratio(follow, "fusion_exact", "fusion", 1),
            cpu_first_fusion_exact_vs_fusion=ratio(first, "fusion_exact", "fusion", 1),
            same_replies=f"{same}/{n}",
            exact_replies_as_full=f"{exact_as_plain}/{n}",
            fusion_exact_replies_as_full=f"{fusion_exact_as_plain}/{n}",
        )
    )


if __name__ == "__main__":
    sys.exit(main())
