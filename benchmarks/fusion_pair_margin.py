"""When does the pair stream pay off? `fusion_pair_margin` chosen from one bench_fidelity run.

A fusion request with `fusion_pair` decides after its first step whether the pair stream joins:
with `fusion_pair_margin` m, only when its two most relevant documents' relevances (mean
log-likelihood of Q per stream) differ by at most m; otherwise it decodes on as plain fusion. Up
to that decision both paths run the same steps, after it the request is exactly
`fusion/contrastive` or `fusion/contrastive/pairlead` (tests/test_fusion.py checks both sides of
the margin against transformers). So one run of those two modes, with each question's relevances
recorded at the decision, gives every margin's replies without a run per margin.

    # record: bench_fidelity's own arguments, with the relevances written to --relevance
    # (several runs on one loaded model: their arguments cut at "---", one --relevance file each)
    python benchmarks/fusion_pair_margin.py record --relevance rel.json -- --set original --split tune \
        --limit 15 --ttft-every 0 --modes full fusion/contrastive fusion/contrastive/pairlead --raw raw.json
    # report: kept / correct per margin, one-document and two-document questions apart
    python benchmarks/fusion_pair_margin.py report --split tune --limit 15 --runs original:raw.json:rel.json

The recording relies on bench_fidelity asking its questions in order and `pairlead` deciding once
per question (ttft-every 0, so no timed one-token request decides too).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import bench_fidelity as bench

from chunkcache.engine import fusion

CONTRASTIVE, LEAD = "fusion/contrastive", "fusion/contrastive/pairlead"
MARGINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.75, 1.0)


def record(paths: list[Path], bench_args: list[str]) -> None:
    """Run bench_fidelity with every pair decision's relevances appended to a file (in order),
    each under the id of the question being asked (so a run over any subset, --docs included,
    pairs with the raw files by question). Several runs (`bench_args` cut at "---", one path
    each) share one loaded model and its chunk pool."""
    runs: list[list[str]] = [[]]
    for arg in bench_args:
        if arg == "---":
            runs.append([])
        else:
            runs[-1].append(arg)
    if len(runs) != len(paths):
        raise SystemExit(f"{len(paths)} --relevance files for {len(runs)} runs")
    records: list[dict[str, Any]] = []
    decide = fusion.FusionGroup.pair_wanted
    progress, load = bench.tqdm, bench.LLM
    asking: dict[str, Any] = {}

    def questions(items, **kwargs):
        for q in progress(items, **kwargs):
            asking["qid"] = q.qid
            yield q

    def recorded(group: fusion.FusionGroup) -> bool:
        n = len(group.prompt.chunks)
        records.append({"qid": asking.get("qid"), "docs": n, "relevance": group.relevance()[:n].tolist()})
        asking["path"].write_text(json.dumps(records))
        return decide(group)

    def loaded(*args, **kwargs):  # one model for every run (they must ask for the same one)
        if asking.get("llm") is None:
            asking["llm"], asking["load"] = load(*args, **kwargs), (args, kwargs)
        assert asking["load"] == (args, kwargs), "the runs ask for different models"
        return asking["llm"]

    bench.tqdm, bench.LLM = questions, loaded
    fusion.FusionGroup.pair_wanted = recorded  # type: ignore[method-assign]
    for path, run in zip(paths, runs, strict=True):
        records.clear()
        asking["path"] = path
        bench.main(run)


def _rows(name: str, raw: dict[str, Any], rel: list[dict[str, Any]], split: str, limit: int, agreeing: bool):
    """Per question of set `name` that both modes answered: its margin, whether the most
    relevant document is one the question names, and each mode's correctness. With `agreeing`,
    also the questions without a recorded relevance on which both modes are equally right (any
    margin gives them the same score), with margin None."""
    elements = bench.fidelity_set.load_elements(None)
    questions = [q for q in bench.load_questions(name) if q.split == split][: limit or None]
    if rel and "qid" in rel[0]:  # recorded by question id
        by_qid = {r["qid"]: r for r in rel}
        pairs = [(q, by_qid[q.qid]) for q in questions if q.qid in by_qid]
        if agreeing:
            answered = [q for q in questions if all(q.qid in raw[m]["correct"] for m in (CONTRASTIVE, LEAD))]
            for q in answered:
                if q.qid not in by_qid and raw[CONTRASTIVE]["correct"][q.qid] == raw[LEAD]["correct"][q.qid]:
                    yield _row(q, raw, None, False, False)
    else:  # older records: in question order, up to the first question a mode did not answer
        pairs = list(zip(questions, rel, strict=False))
    for q, r in pairs:
        if not all(q.qid in raw[m]["correct"] for m in ("full", CONTRASTIVE, LEAD)):
            if "qid" in r:
                continue
            break
        assert r["docs"] == len(q.doc_ids), (q.qid, r["docs"])
        order = sorted(range(r["docs"]), key=lambda k: -r["relevance"][k])
        named = {k for k, n in enumerate(q.doc_ids) if elements[n].name.lower() in q.question.lower()}
        margin = r["relevance"][order[0]] - r["relevance"][order[1]]
        yield _row(q, raw, margin, order[0] in named, named <= set(order[:2]))


def _row(q: Any, raw: dict[str, Any], margin: float | None, top1: bool, top2: bool) -> dict[str, Any]:
    return {
        "hops": q.hops,
        "margin": margin,
        "top1_named": top1,
        "top2_named": top2,
        "full": raw["full"]["correct"][q.qid],
        "con": raw[CONTRASTIVE]["correct"][q.qid],
        "lead": raw[LEAD]["correct"][q.qid],
    }


def _score(rows: list[dict[str, Any]], pick) -> str:
    parts = []
    for label, hops in (("all", (1, 2)), ("1-doc", (1,)), ("2-doc", (2,))):
        rs = [r for r in rows if r["hops"] in hops]
        hits = [pick(r) for r in rs]
        kept = sum(h and r["full"] for h, r in zip(hits, rs, strict=True))
        parts.append(f"{label} {kept}/{sum(r['full'] for r in rs)} kept, {sum(hits)} correct")
    return "; ".join(parts)


def report(
    split: str, limit: int, runs: list[str], scored: tuple[float, ...] = MARGINS, agreeing: bool = False
) -> None:
    rows: list[dict[str, Any]] = []
    for run in runs:
        name, raws, rels = run.split(":")
        raw: dict[str, Any] = {}  # mode -> {"correct": {qid: bool}}, merged over the files
        for path in raws.split(","):
            for mode, res in json.loads(Path(path).read_text()).items():
                raw.setdefault(mode, {"correct": {}})["correct"].update(res["correct"])
        rel = [r for path in rels.split(",") for r in json.loads(Path(path).read_text())]
        rows += _rows(name, raw, rel, split, limit, agreeing)
    known = [r for r in rows if r["margin"] is not None]
    print(
        f"{len(rows)} questions ({sum(r['hops'] == 2 for r in rows)} need two documents), "
        f"margins recorded on {len(known)} ({sum(r['hops'] == 2 for r in known)} two-document)"
    )
    for hops in (1, 2):
        rs = [r for r in known if r["hops"] == hops]
        spread = ", ".join(f"{r['margin']:.2f}" for r in sorted(rs, key=lambda r: r["margin"]))
        print(
            f"{hops}-doc: most relevant stream's document named by the question {sum(r['top1_named'] for r in rs)}"
            f"/{len(rs)}, both named among the top two {sum(r['top2_named'] for r in rs)}/{len(rs)}; "
            f"margins {spread}"
        )
    print(f"{'full':<30}{_score(rows, lambda r: r['full'])}")
    print(f"{CONTRASTIVE:<30}{_score(rows, lambda r: r['con'])}")
    print(f"{LEAD:<30}{_score(rows, lambda r: r['lead'])}")
    # Most of full's answers kept, then the fewest pairs added (the TTFT): the smallest such margin.
    best = None
    for m in sorted(scored):
        pick = lambda r, m=m: r["lead"] if r["margin"] is not None and r["margin"] <= m else r["con"]  # noqa: E731
        kept = sum(pick(r) and r["full"] for r in rows)
        correct = sum(map(pick, rows))
        paired = [sum(r["margin"] <= m for r in known if r["hops"] == h) for h in (1, 2)]
        counts = [sum(r["hops"] == h for r in known) for h in (1, 2)]
        print(
            f"{'margin ' + str(m):<30}{_score(rows, pick)}; pair added {sum(paired)}/{len(known)} "
            f"(1-doc {paired[0]}/{counts[0]}, 2-doc {paired[1]}/{counts[1]})"
        )
        if best is None or kept > best[1]:
            best = (m, kept, correct)
    assert best is not None
    print(
        f"SUMMARY fusion_pair_margin split={split} n={len(rows)} best_margin={best[0]} kept={best[1]} "
        f"correct={best[2]} full={sum(r['full'] for r in rows)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--relevance", type=Path, nargs="+", required=True, help="one per run")
    rec.add_argument("bench_args", nargs=argparse.REMAINDER)
    rep = sub.add_parser("report")
    rep.add_argument("--split", default="tune")
    rep.add_argument("--limit", type=int, default=0)
    rep.add_argument(
        "--margins",
        type=float,
        nargs="+",
        default=list(MARGINS),
        help="the margins to score (on held-out questions: only the one chosen on tune)",
    )
    rep.add_argument(
        "--agreeing",
        action="store_true",
        help="count the questions without a recorded relevance on which both modes are equally right",
    )
    rep.add_argument(
        "--runs",
        nargs="+",
        required=True,
        help="SET:RAW.json[,RAW2.json...]:RELEVANCE.json[,...] (raw files merged per mode)",
    )
    args = parser.parse_args()
    if args.command == "record":
        record(args.relevance, [a for a in args.bench_args if a != "--"])
    else:
        report(args.split, args.limit, args.runs, tuple(args.margins), args.agreeing)


if __name__ == "__main__":
    sys.exit(main())
