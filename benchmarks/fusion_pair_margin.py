"""When does the pair stream pay off? `fusion_pair_margin` chosen from one bench_fidelity run.

A fusion request with `fusion_pair` decides after its first step whether the pair stream joins:
with `fusion_pair_margin` m, only when its two most relevant documents' relevances (mean
log-likelihood of Q per stream) differ by at most m; otherwise it decodes on as plain fusion. Up
to that decision both paths run the same steps, after it the request is exactly
`fusion/contrastive` or `fusion/contrastive/pairlead` (tests/test_fusion.py checks both sides of
the margin against transformers). So one run of those two modes, with each question's relevances
recorded at the decision, gives every margin's replies without a run per margin.

    # record: bench_fidelity's own arguments, with the relevances written to --relevance
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
MARGINS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)


def record(path: Path, bench_args: list[str]) -> None:
    """Run bench_fidelity with every pair decision's relevances appended to `path` (in order)."""
    records: list[dict[str, Any]] = []
    decide = fusion.FusionGroup.pair_wanted

    def recorded(group: fusion.FusionGroup) -> bool:
        n = len(group.prompt.chunks)
        records.append({"docs": n, "relevance": group.relevance()[:n].tolist()})
        path.write_text(json.dumps(records))
        return decide(group)

    fusion.FusionGroup.pair_wanted = recorded  # type: ignore[method-assign]
    bench.main(bench_args)


def _rows(name: str, raw: dict[str, Any], rel: list[dict[str, Any]], split: str, limit: int):
    """Per question of set `name` that both modes answered: its margin, whether the most
    relevant document is one the question names, and each mode's correctness."""
    elements = bench.fidelity_set.load_elements(None)
    questions = [q for q in bench.load_questions(name) if q.split == split][: limit or None]
    for q, r in zip(questions, rel, strict=False):
        if q.qid not in raw[LEAD]["correct"]:
            break
        assert r["docs"] == len(q.doc_ids), (q.qid, r["docs"])
        order = sorted(range(r["docs"]), key=lambda k: -r["relevance"][k])
        named = {k for k, n in enumerate(q.doc_ids) if elements[n].name.lower() in q.question.lower()}
        yield {
            "hops": q.hops,
            "margin": r["relevance"][order[0]] - r["relevance"][order[1]],
            "top1_named": order[0] in named,
            "top2_named": named <= set(order[:2]),
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


def report(split: str, limit: int, runs: list[str]) -> None:
    rows: list[dict[str, Any]] = []
    for run in runs:
        name, raw, rel = run.split(":")
        rows += _rows(
            name, json.loads(Path(raw).read_text()), json.loads(Path(rel).read_text()), split, limit
        )
    print(f"{len(rows)} questions ({sum(r['hops'] == 2 for r in rows)} need two documents)")
    for hops in (1, 2):
        rs = [r for r in rows if r["hops"] == hops]
        margins = ", ".join(f"{r['margin']:.2f}" for r in sorted(rs, key=lambda r: r["margin"]))
        print(
            f"{hops}-doc: most relevant stream's document named by the question {sum(r['top1_named'] for r in rs)}"
            f"/{len(rs)}, both named among the top two {sum(r['top2_named'] for r in rs)}/{len(rs)}; "
            f"margins {margins}"
        )
    print(f"{'full':<30}{_score(rows, lambda r: r['full'])}")
    print(f"{CONTRASTIVE:<30}{_score(rows, lambda r: r['con'])}")
    print(f"{LEAD:<30}{_score(rows, lambda r: r['lead'])}")
    best = None  # most of full's answers kept, then most correct, then the smallest margin
    for m in MARGINS:
        pick = lambda r, m=m: r["lead"] if r["margin"] <= m else r["con"]  # noqa: E731
        kept = sum(pick(r) and r["full"] for r in rows)
        correct = sum(map(pick, rows))
        paired = sum(r["margin"] <= m for r in rows)
        print(f"{'margin ' + str(m):<30}{_score(rows, pick)}; pair added {paired}/{len(rows)}")
        if best is None or (kept, correct) > best[1:]:
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
    rec.add_argument("--relevance", type=Path, required=True)
    rec.add_argument("bench_args", nargs=argparse.REMAINDER)
    rep = sub.add_parser("report")
    rep.add_argument("--split", default="tune")
    rep.add_argument("--limit", type=int, default=0)
    rep.add_argument("--runs", nargs="+", required=True, help="SET:RAW.json:RELEVANCE.json")
    args = parser.parse_args()
    if args.command == "record":
        record(args.relevance, [a for a in args.bench_args if a != "--"])
    else:
        report(args.split, args.limit, args.runs)


if __name__ == "__main__":
    sys.exit(main())
