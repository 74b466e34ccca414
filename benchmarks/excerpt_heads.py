"""Which attention heads find the asked line of a document: a locator for the joint stream's
excerpts that does not depend on the question's words (engine/excerpt.py finds facts by words,
and loses them where the question paraphrases the document: benchmarks/RESULTS.md
"bench_rag_shape").

For each two-, three- and free-form question of bench_rag_shape's set (N = 8, ~500-token
documents, a split; the frozen wording and `rag_shape_set.paraphrased`), and each document it asks
about, the prompt a document's own fusion stream reads (system turn, ` # # ` document ` # # `
question, the model's chat template; the document tokenized alone, as the chunk cache holds it)
runs through transformers (the GGUF dequantized to bfloat16, eager attention). Per layer and head,
the attention the question rows give each span of the document (engine/excerpt.py's spans: lines,
sentences within a line) is summed; a head `finds` the document's asked line where that line is
among its top k spans; `words`: the excerpt of engine/excerpt.py (`--budget`) states the asked
value. Reported: the best single heads, and either the heads given (`--heads`,
each head's mass normalized over the spans, summed) or a greedy choice (`--choose N`: the head
that most raises top-2 finds over both wordings, N times); one SUMMARY line. Choose on tune,
check on held-out. `words+k`: the words' excerpt or the heads' top k spans. The per-document masses go to `--raw` (torch.save), which a rerun reads instead
of running the model.

    python benchmarks/excerpt_heads.py --split tune --choose 3 --raw heads_tune.pt
    python benchmarks/excerpt_heads.py --split heldout --heads 16/4,12/1,20/9 --raw heads_heldout.pt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import common
import rag_shape_set
import torch
from tqdm import tqdm

from chunkcache.config import ChunkConfig
from chunkcache.engine.excerpt import SpanTable, excerpt
from chunkcache.fidelity import rag_shape as rs
from chunkcache.fidelity.measure import render

KINDS = ("two", "three", "free")
WORDINGS = ("frozen", "paraphrase")


def documents(args: argparse.Namespace) -> list[tuple[str, rs.RagQuestion, str, str]]:
    """(wording, question, document, the value it states) for each asked document."""
    records = rs.load_records()
    qs = [q for q in rs.load() if q.n == 8 and q.split == args.split and q.kind in KINDS]
    out = []
    for wording in WORDINGS:
        for q in rag_shape_set.worded(qs, records, wording):
            docs = dict(zip(q.doc_ids, q.documents(records, 500), strict=True))
            new = {e.doc_id: e.new for e in q.edits if e.field == q.field}
            out += [(wording, q, docs[e.doc_id], new.get(e.doc_id, e.old)) for e in q.edits]
    return out


def measure(args: argparse.Namespace) -> list[dict]:
    """Per asked document: the question rows' attention per layer, head and span, and which spans
    state the asked value."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(common.bench_model(args))
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, torch_dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    table = SpanTable.of(tok, len(tok))
    records = []
    for wording, q, doc, value in tqdm(documents(args), desc="documents"):
        # The chunked prompt as bench_rag_shape renders it, this document alone; split around it so
        # that the document is tokenized alone, as the chunk cache holds it.
        text = render(tok, ["@@DOC@@"], q.question, ChunkConfig().separator)
        head, tail = text.split("@@DOC@@")
        head_ids, doc_ids = (tok(t, add_special_tokens=False)["input_ids"] for t in (head, doc))
        ids = head_ids + doc_ids + tok(tail, add_special_tokens=False)["input_ids"]
        start, end = len(head_ids), len(head_ids) + len(doc_ids)
        spans = table.spans(doc_ids)
        target = [k for k, (a, b) in enumerate(spans) if rs.occurrences(value, tok.decode(doc_ids[a:b]))]
        question = tok(q.question, add_special_tokens=False)["input_ids"]
        words = rs.occurrences(value, tok.decode(excerpt(doc_ids, question, table, args.budget))) > 0
        with torch.no_grad():
            attentions = model(torch.tensor([ids]), output_attentions=True).attentions
        # layers x heads x spans: the question rows' attention on each span, summed.
        rows = torch.stack([a[0, :, end:, start:end].float().sum(1) for a in attentions])
        mass = torch.stack([rows[:, :, a:b].sum(-1) for a, b in spans], -1)
        records.append({"wording": wording, "qid": q.qid, "target": target, "mass": mass, "words": words})
    return [r for r in records if r["target"]]


def finds(
    records: list[dict], heads: list[tuple[int, int]], wording: str, k: int, words: bool = False
) -> float:
    """The share of documents whose asked line is among the top k spans of the heads' summed,
    per-head normalized mass (`words`: or in the words' excerpt)."""
    mine = [r for r in records if r["wording"] == wording]
    hit = 0
    for r in mine:
        m = r["mass"] / r["mass"].sum(-1, keepdim=True)
        score = sum((m[layer, head] for layer, head in heads), torch.zeros(m.shape[-1]))
        top = score.topk(min(k, score.numel())).indices.tolist() if heads else []
        hit += (words and r["words"]) or any(t in r["target"] for t in top)
    return hit / len(mine)


def rates(records: list[dict], heads: list[tuple[int, int]]) -> str:
    alone = [f"{w}@{k}={finds(records, heads, w, k):.2f}" for w in WORDINGS for k in (1, 2, 3)]
    words = [f"{w}_words={finds(records, [], w, 0, True):.2f}" for w in WORDINGS]
    union = [f"{w}_words+{k}={finds(records, heads, w, k, True):.2f}" for w in WORDINGS for k in (1, 2)]
    return " ".join(alone + words + union)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="default", help="a short name (default) or a GGUF path")
    parser.add_argument("--split", choices=("tune", "heldout"), default="tune")
    parser.add_argument("--heads", default="", help="LAYER/HEAD,... to score together")
    parser.add_argument("--choose", type=int, default=0, help="choose this many heads greedily")
    parser.add_argument("--budget", type=int, default=48, help="the words' excerpt budget (tokens)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--raw", type=Path, default=None, help="the masses (torch.save); read if it exists")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.raw is not None and args.raw.exists():
        records = torch.load(args.raw)
    else:
        records = measure(args)
        if args.raw is not None:
            torch.save(records, args.raw)
    layers, heads = records[0]["mass"].shape[:2]
    every = [(layer, head) for layer in range(layers) for head in range(heads)]
    for wording in WORDINGS:
        best = sorted(every, key=lambda h: -finds(records, [h], wording, 2))[:5]
        print(
            f"{wording}: best heads at top 2:",
            ", ".join(f"{a}/{b} {finds(records, [(a, b)], wording, 2):.2f}" for a, b in best),
        )
    chosen = [tuple(map(int, h.split("/"))) for h in args.heads.split(",") if h]
    for _ in range(args.choose):
        chosen.append(
            max(
                (h for h in every if h not in chosen),
                key=lambda h: sum(finds(records, [*chosen, h], w, 2) for w in WORDINGS),
            )
        )
    heads_text = ",".join(f"{a}/{b}" for a, b in chosen)
    print(
        f"SUMMARY excerpt_heads: split={args.split} documents={len(records)} heads={heads_text} "
        + (rates(records, chosen) if chosen else "")
    )


if __name__ == "__main__":
    sys.exit(main())
