"""The frozen real-shape RAG questions (issue 56): the file is what the generator draws, each edit
is made everywhere in its document at every size, the expected values are in the edited documents
only, and the rule-based check scores known replies right."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("mendeleev")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import rag_shape_set

from chunkcache.fidelity import rag_shape as rs


@pytest.fixture(scope="module")
def questions() -> list[rs.RagQuestion]:
    return rs.load()


def test_frozen_set_matches_its_seed(questions: list[rs.RagQuestion]) -> None:
    assert rs.fingerprint(questions) == rs.fingerprint(rag_shape_set.build())
    cells = {(q.n, q.kind, q.split) for q in questions}
    assert cells == {(n, k, s) for n in rag_shape_set.NS for k in rs.KINDS for s in ("tune", "heldout")}


def test_edits_apply_and_answers_are_in_the_edited_documents_only(questions: list[rs.RagQuestion]) -> None:
    records = rs.load_records()
    for q in questions[:: len(rag_shape_set.NS)]:  # a third of them: every kind, form and N
        for size in rs.SIZES:
            docs = dict(zip(q.doc_ids, q.documents(records, size), strict=True))
            for edit in q.edits:
                assert rs.occurrences(edit.old, docs[edit.doc_id]) == 0, (q.qid, edit)
                for n, doc in docs.items():
                    assert (rs.occurrences(edit.new, doc) > 0) == (n == edit.doc_id), (q.qid, edit, n)
                    assert rs.occurrences(edit.new, records[n].document(size)) == 0


def test_a_stale_edit_is_refused() -> None:
    doc = rs.load_records()[26].document(300)  # Iron: "Density at 295K: 7.87 g/cm^3"
    edit = rs.Edit(26, "density", "7.87", "6.41", {"300": 1})
    assert "6.41 g/cm^3" in rs.apply(doc, edit, 300)
    with pytest.raises(ValueError, match="does not apply"):
        rs.apply(doc, rs.Edit(26, "density", "7.87", "6.41", {"300": 2}), 300)


def _question(form: str, answers: list[list[str]], choices: list[str] = ()) -> rs.RagQuestion:
    return rs.RagQuestion("x", "one", form, "density", "?", answers, list(choices), [], [1], "tune")


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("The melting point is 1811.15 K.", True),
        ("1,811.15 K", True),
        ("about 1811 K", True),  # rounded, 4 significant digits
        ("1811.2 K", True),
        ("1811.16 K", False),
        ("21811.15", False),
        ("It melts at 1812 K", False),
    ],
)
def test_numbers_match_as_written_or_rounded(reply: str, expected: bool) -> None:
    assert rs.score(_question("value", [["1811.15"]]), reply)[0] is expected


def test_short_roundings_and_two_values() -> None:
    q = _question("values", [["7.87"], ["0.534"]])
    assert rs.score(q, "7.87 and 0.534 g/cm^3") == (True, 1.0)
    assert rs.score(q, "7.9 and 0.534") == (False, 0.5)  # two significant digits: not enough
    assert rs.score(q, "7.870 g/cm^3; 0.53") == (False, 0.5)


def test_choices_and_counts() -> None:
    higher = _question("higher", [["Zinc"]], ["Zinc", "Lanthanum"])
    assert rs.score(higher, "Zinc has the higher density.")[0]
    assert not rs.score(higher, "Lanthanum (6.15) is denser than Zinc.")[0]
    assert not rs.score(higher, "I don't know.")[0]
    count = _question("count", [["2"]])
    assert rs.score(count, "2")[0] and rs.score(count, "Two of them: Cobalt and Zinc.")[0]
    assert not rs.score(count, "One: Cobalt (2895.41 K).")[0]
    assert not rs.score(count, "Cobalt 2.5 and 3 others")[0]
    assert rs.score(count, "Lithium (Li, atomic number 3)\nTwo of them.")[0]


def _record(reply: str, ttft: float, cold: float | None = None) -> dict:
    run = {"reply": reply, "ttft": ttft, "decode": [10, 0.5], "kv_bytes": 2**20, "pool_bytes": 0}
    return {"run": run, "prompt_tokens": 4000, **({} if cold is None else {"ttft_cold": cold})}


def _right(q: rs.RagQuestion) -> str:
    return " and ".join(group[0] for group in q.answers)


def test_the_report_counts_answers_kept_and_speedups() -> None:
    import bench_rag_shape as bench

    qs = bench.select(rs.load(), 8, "tune", 1)
    assert [q.kind for q in qs] == list(rs.KINDS)
    raw = {}
    for q in qs:
        raw[f"8x500/{q.qid}/full"] = _record(_right(q), 1.0, cold=1.0)
        raw[f"8x500/{q.qid}/closed"] = _record("I do not know.", 0.1)
        raw[f"8x500/{q.qid}/default"] = _record(_right(q) if q.kind != "three" else "?", 0.1, cold=0.5)
    raw[f"16x500/{qs[0].qid}/full"] = {"error": "prompt is 9000 tokens long", "prompt_tokens": 9000}
    rows = bench.cell_rows(raw, "8x500", qs, ["closed", "full", "default"])
    row = next(r for r in rows if r["type"] == "all" and r["mode"] == "default")
    assert (row["correct"], row["kept"], row["lost"], row["gained"]) == (3, 3, 1, 0)
    assert row["warm_x"] == pytest.approx(10.0) and row["cold_x"] == pytest.approx(2.0)
    assert row["mem_vs_full"] == pytest.approx(1.0) and row["decode_vs_full"] == pytest.approx(1.0)
    assert "default@8x500=kept3/4" in bench.summary_line(rows)
    assert bench.refused(raw, "8x500", qs, ["closed", "full", "default"]) is None
    assert "1 questions refused" in bench.refused(raw, "16x500", qs[:1], ["full"])


def test_calibrate_builtin_prompts_carry_the_real_shape() -> None:
    """`chunkcache calibrate`'s built-in set holds the real shape (8 documents of ~500 tokens, each
    kind in turn), scored by its own rules, free-form replies long enough for their facts."""
    from chunkcache.fidelity import prompts as fp
    from chunkcache.fidelity import questions as fq

    rag = fp.rag_prompts("heldout")
    assert len(rag) == sum(q.n == 8 and q.split == "heldout" for q in rs.load())
    assert [p.rag.kind for p in rag[:4]] == list(rs.KINDS)
    assert all(len(p.documents) == 8 and p.rag.split == "heldout" for p in rag)
    assert all(rs.estimate(d) > 300 for d in rag[0].documents)
    assert {p.tokens(24) for p in rag if p.rag.kind == "free"} == {fp.RAG_FREE_TOKENS}
    assert {p.tokens(24) for p in rag if p.rag.kind != "free"} == {24}
    comparison = next(p for p in rag if p.rag.form in ("higher", "highest"))
    right = comparison.rag.answers[0][0]
    wrong = next(c for c in comparison.rag.choices if c != right)
    reply = f"{wrong}, not {right}."  # the words are there, the choice is wrong
    assert fq.correct(reply, [list(g) for g in comparison.answers]) and not comparison.correct(reply)
    assert comparison.correct(f"{right}.")
    mixed = fp.builtin(6, "all", "tune")
    assert [p.rag is not None for p in mixed] == [False, True] * 3
    assert all(p.rag is None for p in fp.builtin(4, "both", "tune"))
    with pytest.raises(ValueError, match="set must be one of"):
        fp.builtin(1, "everything")
