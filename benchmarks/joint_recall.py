"""Which documents would the joint stream read? `fusion_pair_margin` and `fusion_max_joint` chosen
from each question's relevances, recorded once.

A fusion request with `fusion_pair` decides after its first step which documents its joint stream
reads: every document whose relevance (its stream's mean log-likelihood of Q) is within the margin
of the most relevant one's, at most `fusion_max_joint` (engine/fusion.py `JointChoice`). The
relevances do not depend on the margin or on k, so one first step per question (the documents
cached first, as a warm request finds them) gives every (margin, k)'s choice. Scored against the
documents each real-shape question needs (bench_rag_shape's set: the documents whose facts it
asks, its edits): per type, the share of questions whose joint stream holds all of them ("covered";
one-document questions are covered by their own stream when no joint stream joins and the top
document is theirs), and the mean number of documents the joint stream reads (its cost: each one
beyond the first is blended or prefilled before the first token).

    python benchmarks/joint_recall.py --model default --n 8 --size 500 --split tune --raw rel.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import bench_rag_shape as bench
import common
from tqdm import tqdm

from chunkcache import LLM, SamplingParams
from chunkcache.engine import fusion
from chunkcache.fidelity import measure
from chunkcache.fidelity import rag_shape as rs

MARGINS = (0.2, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0)
JOINTS = (2, 3, 4)
DECIDE = {"fusion_pair": "lead", "fusion_pair_margin": 0.0}  # decides (records), never joins


def record(llm: LLM, qs: list[rs.RagQuestion], size: int) -> dict[str, list[float]]:
    """Per question id, its documents' relevances in prompt order, from one warm first step."""
    seen: list[list[float]] = []
    decide = fusion.FusionGroup.pair_wanted

    def spy(group: fusion.FusionGroup) -> bool:
        seen.append(group.relevance()[: len(group.prompt.chunks)].tolist())
        return decide(group)

    records, out = rs.load_records(), {}
    one = SamplingParams(temperature=0, max_tokens=1)
    fusion.FusionGroup.pair_wanted = spy  # type: ignore[method-assign]
    try:
        for q in tqdm(qs, desc="relevance", unit="question"):
            p = bench.prompts(llm, q, records, size)
            bench.request(llm, p.reversed_text, one, DECIDE, salt=p.salt)  # the documents cached
            seen.clear()
            bench.request(llm, p.text, one, DECIDE, salt=p.salt)
            out[q.qid] = seen[-1]
    finally:
        fusion.FusionGroup.pair_wanted = decide  # type: ignore[method-assign]
    return out


def needed(q: rs.RagQuestion) -> set[int]:
    """Prompt indices of the documents whose facts the question asks (its edited documents)."""
    return {q.doc_ids.index(e.doc_id) for e in q.edits}


def report(qs: list[rs.RagQuestion], relevance: dict[str, list[float]]) -> None:
    kinds = [k for k in rs.KINDS if any(q.kind == k for q in qs)]
    print(f"{'margin':>6} {'k':>2} " + " ".join(f"{k + ' covered':>15} {'docs':>5}" for k in kinds))
    for margin in MARGINS:
        for most in JOINTS:
            cells = []
            for kind in kinds:
                part = [q for q in qs if q.kind == kind and q.qid in relevance]
                choices = [fusion.JointChoice.choose(relevance[q.qid], margin, most) for q in part]
                covered = sum(needed(q) <= set(c.documents) for q, c in zip(part, choices, strict=True))
                docs = sum(len(c.documents) for c in choices) / max(1, len(part))
                cells.append(f"{covered:>9}/{len(part):<5} {docs:>5.2f}")
            print(f"{margin:>6} {most:>2} " + " ".join(cells))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--n", type=int, default=8, choices=(4, 8, 16))
    parser.add_argument("--size", type=int, default=500, choices=rs.SIZES)
    parser.add_argument("--split", choices=("tune", "heldout"), default="tune")
    parser.add_argument("--questions", type=int, default=8, help="per type (at most 8)")
    parser.add_argument("--raw", type=Path, required=True, help="relevances (JSON; a rerun only reports)")
    args = parser.parse_args(argv)
    qs = bench.select(rs.load(), args.n, args.split, args.questions)
    relevance: dict[str, Any] = json.loads(args.raw.read_text()) if args.raw.exists() else {}
    todo = [q for q in qs if q.qid not in relevance]
    if todo:
        args.model = common.bench_model(args)
        llm = LLM(args.model, device="cpu", dtype=args.dtype, threads=args.threads, **measure.ENGINE_OPTIONS)
        relevance.update(record(llm, todo, args.size))
        args.raw.write_text(json.dumps(relevance, indent=0))
    report(qs, relevance)


if __name__ == "__main__":
    sys.exit(main())
