"""The frozen counterfactual questions: each edit is made everywhere in its document, and the
asked-for value is in the edited document only (so only reading it can give the answer)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("mendeleev")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import counterfactual_set
import fidelity_set


def test_frozen_set_matches_its_seed_and_edits_are_consistent() -> None:
    questions = counterfactual_set.load()
    # Frozen from the generator as committed: rebuilding with the seed gives the same file.
    assert fidelity_set.fingerprint(questions) == fidelity_set.fingerprint(counterfactual_set.build())
    elements = fidelity_set.load_elements()
    assert {q.split for q in questions} == {"tune", "heldout"}
    for q in questions:
        docs = q.documents(elements)
        assert len(q.edits) == q.hops and 3 <= len(docs) <= 5
        for edit, answer, memory in zip(q.edits, q.answers, q.memory, strict=True):
            assert answer == [edit.new] and memory == [edit.old] and edit.new != edit.old
            for n, doc in zip(q.doc_ids, docs, strict=True):
                new = counterfactual_set.occurrences(edit.field, edit.new, doc)
                assert (new > 0) == (n == edit.doc_id), (q.qid, edit, n)
            edited = docs[q.doc_ids.index(edit.doc_id)]
            assert counterfactual_set.occurrences(edit.field, edit.old, edited) == 0
            assert fidelity_set.correct(edited, [answer])


def test_an_edit_that_no_longer_matches_the_text_is_refused() -> None:
    el = fidelity_set.load_elements()[9]  # Fluorine: "isolated by Moissan in 1886"
    edit = counterfactual_set.Edit(9, "year", "1886", "1900", 1)
    assert "1900" in counterfactual_set.apply(el, edit).text
    with pytest.raises(ValueError, match="does not apply"):
        counterfactual_set.apply(el, counterfactual_set.Edit(9, "year", "1886", "1900", 2))
    with pytest.raises(ValueError, match="does not apply"):
        counterfactual_set.apply(el, counterfactual_set.Edit(9, "year", "1887", "1900", 0))
