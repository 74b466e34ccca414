"""Whether the joint stream's excerpts (`fusion_joint_excerpt`, engine/excerpt.py) hold the facts
bench_rag_shape's questions ask, per budget, document size and question type: no model runs,
only the tokenizer.

For every frozen question (chunkcache/data/rag_shape_questions.json, a split) and every document
it names (an element in the question), the document of each size is cut to its excerpt at each
budget as the engine cuts a joint stream's later document, and counted `held` where the excerpt
still states the asked value (the edited one where the question's edit changed it). `tokens`: the
excerpt's mean length; `whole`: the share of documents read whole (no span but the first shares a
word with the question). A budget whose held share is below 1 loses facts before any model sees
them; that is the ceiling of what the joint stream can answer with it.

    python benchmarks/excerpt_recall.py --model default --budgets 32 48 96
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict

import common
from rag_shape_set import WORDING_HELP, WORDINGS, worded

from chunkcache.engine.excerpt import SpanTable, excerpt
from chunkcache.fidelity import rag_shape as rs
from chunkcache.model.gguf_tokenizer import load_gguf_tokenizer_without_torch


def asked(q: rs.RagQuestion, records: dict[int, rs.Record], size: int) -> list[tuple[str, str]]:
    """(document, the value it must state) for each document the question names."""
    docs = dict(zip(q.doc_ids, q.documents(records, size), strict=True))
    new = {e.doc_id: e.new for e in q.edits if e.field == q.field}
    return [
        (docs[n], new.get(n, records[n].values[q.field])) for n in q.doc_ids if records[n].name in q.question
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="a short name (default, smollm2) or a GGUF path")
    parser.add_argument("--budgets", type=int, nargs="+", default=[32, 48, 64, 96])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(rs.SIZES), choices=rs.SIZES)
    parser.add_argument("--split", choices=("tune", "heldout", "both"), default="both")
    parser.add_argument("--wording", choices=WORDINGS, default="frozen", help=WORDING_HELP)
    args = parser.parse_args(argv)
    tokenizer = load_gguf_tokenizer_without_torch(common.bench_model(args))
    table = SpanTable.of(tokenizer, len(tokenizer))
    records = rs.load_records()
    questions = [
        q
        for q in worded(rs.load(), records, args.wording)
        if args.split in ("both", q.split) and q.kind != "one"
    ]
    held: dict[tuple[int, int, str], list[bool]] = defaultdict(list)
    tokens: dict[tuple[int, int, str], list[int]] = defaultdict(list)
    whole: dict[tuple[int, int, str], list[bool]] = defaultdict(list)
    for size in args.sizes:
        for q in questions:
            question = tokenizer.encode(q.question, add_special_tokens=False)
            for doc, value in asked(q, records, size):
                ids = tokenizer.encode(doc, add_special_tokens=False)
                for b in args.budgets:
                    kept = excerpt(ids, question, table, b)
                    key = (size, b, q.kind)
                    held[key].append(rs.occurrences(value, tokenizer.decode(kept)) > 0)
                    tokens[key].append(len(kept))
                    whole[key].append(len(kept) == len(ids) > b)
    print(f"{'size':>5} {'budget':>6} {'type':>6} {'docs':>5} {'held':>6} {'tokens':>7} {'whole':>6}")
    summary = []
    for key in sorted(held):
        size, b, kind = key
        h, t, w = held[key], tokens[key], whole[key]
        print(
            f"{size:>5} {b:>6} {kind:>6} {len(h):>5} {sum(h) / len(h):>6.2f} {sum(t) / len(t):>7.1f} {sum(w) / len(w):>6.2f}"
        )
    for size in args.sizes:
        for b in args.budgets:
            h = [x for k in held if k[:2] == (size, b) for x in held[k]]
            summary.append(f"{size}/{b}={sum(h) / len(h):.2f}")
    print(f"SUMMARY excerpt_recall: split={args.split} wording={args.wording} held " + " ".join(summary))


if __name__ == "__main__":
    sys.exit(main())
