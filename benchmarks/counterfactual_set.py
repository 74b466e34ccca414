"""Counterfactual questions: answers a model cannot know from memory, only read in a document.

A model that knows the elements answers most of `fidelity_set`'s questions without the documents,
so those questions measure memory as much as reuse. Here the answer's document is a real
`mendeleev` document with one fact replaced by another real value of its kind, taken from another
element, and the question asks for that fact:

- symbol / number: the title line's symbol or atomic number (the symbol's every occurrence in the
  text too, e.g. "SnO2"; an element whose atomic number appears in its text is not used);
- year: every occurrence of the discovery year in the text (only where the text holds it);
- discoverer: every occurrence of the discoverer's surname in the text (only where the text names
  exactly one of the discoverers);
- two_symbols / two_numbers / two_years: the same edit in two documents, both asked for.

The new value appears in no document of the prompt before the edit (so only the edited document
can supply it) and the old value in none of the edited document after it. The other 2-4 documents
are of the same kind (for year and discoverer questions, elements whose own text states a year, or
a discoverer), as a retriever returns alike documents. Drawn once with a fixed seed and frozen in
`chunkcache/data/counterfactual_questions.json` (with the replaced values and their counts,
checked when the documents are built) before any mode ran on it; half tune, half held-out, as
`fidelity_set`.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from fidelity_set import Element, describe, load_elements, write_frozen

# Edits, their check and the frozen file are the package's (chunkcache/fidelity/questions.py).
from chunkcache.fidelity.questions import COUNTERFACTUAL as FROZEN
from chunkcache.fidelity.questions import CounterfactualQuestion, Edit, apply, occurrences
from chunkcache.fidelity.questions import load_counterfactual as load

__all__ = ["FROZEN", "CounterfactualQuestion", "Edit", "apply", "build", "load", "occurrences"]

SEED = 32
# Symbols that are also English words (a capitalised "In" or "As" starts sentences): never edited.
# One-letter symbols ("S" in "U.S.", "C" in "CFC") neither.
_WORDLIKE = {"In", "As", "At", "Be", "No", "He", "Am", "Es", "Pa", "Ac"}
# kind -> how many questions to draw (about 120, half held out)
COUNTS = {
    "symbol": 20,
    "number": 20,
    "year": 20,
    "discoverer": 16,
    "two_symbols": 14,
    "two_numbers": 15,
    "two_years": 15,
}


def _surname(el: Element) -> str | None:
    """The one discoverer's name in the element's text, if exactly one of them is there."""
    if not el.discoverers or "ancient" in el.discoverers.lower():
        return None
    names = {w for w in re.findall(r"[A-Z][a-z]{2,}", el.discoverers) if w != "Sir"}
    present = [n for n in names if occurrences("discoverer", n, el.text)]
    return present[0] if len(present) == 1 else None


def _value(el: Element, field: str) -> str | None:
    """The element's value of `field` if it can be edited consistently, else None."""
    if field == "symbol":
        return None if el.symbol in _WORDLIKE or len(el.symbol) == 1 else el.symbol
    if field == "number":
        return None if occurrences("number", str(el.number), el.text) else str(el.number)
    if field == "year":
        return str(el.year) if el.year and occurrences("year", str(el.year), el.text) else None
    return _surname(el)


def _count(el: Element, field: str, value: str) -> int:
    return occurrences(field, value, el.text) + (field in ("symbol", "number"))


_QUESTION = {
    "symbol": ("What is the chemical symbol of {}?", "What are the chemical symbols of {} and {}?"),
    "number": ("What is the atomic number of {}?", "What are the atomic numbers of {} and {}?"),
    "year": ("In what year was {} discovered?", "In what years were {} and {} discovered?"),
    "discoverer": ("Who discovered {}?", None),
}


def _field(kind: str) -> str:
    return kind.removeprefix("two_").removesuffix("s")  # two_years -> year


def _draft(rng: random.Random, elements: dict[int, Element], kind: str, used: set[tuple[int, str]]):
    """One question of `kind`: (question, answers, memory, doc ids, edits), or None."""
    field = _field(kind)
    hops = 2 if kind.startswith("two_") else 1
    editable = [n for n in sorted(elements) if _value(elements[n], field) and (n, field) not in used]
    alike = (
        [n for n in sorted(elements) if _value(elements[n], field)]
        if field in ("year", "discoverer")
        else None
    )
    targets = rng.sample(editable, hops)
    pool = [n for n in (alike or sorted(elements)) if n not in targets]
    docs = targets + rng.sample(pool, rng.randint(3, 5) - hops)
    rng.shuffle(docs)
    texts = " ".join(elements[n].document() for n in docs)
    values = sorted({_value(elements[n], field) for n in elements if _value(elements[n], field)} - {None})
    edits = []
    for n in targets:
        old = _value(elements[n], field)
        fresh = [v for v in values if v != old and not occurrences(field, v, texts)]
        fresh = [v for v in fresh if v not in {e.new for e in edits} and v not in _WORDLIKE]
        if not fresh:
            return None
        edits.append(Edit(n, field, old, rng.choice(fresh), _count(elements[n], field, old)))
    names = [elements[n].name for n in targets]
    question = _QUESTION[field][hops - 1].format(*names)
    return question, [[e.new] for e in edits], [[e.old] for e in edits], docs, edits, targets


def build(seed: int = SEED) -> list[CounterfactualQuestion]:
    elements = load_elements()
    rng = random.Random(seed)
    drafts = []
    for kind, count in COUNTS.items():
        used: set[tuple[int, str]] = set()  # an element's fact is edited in one question only
        while sum(d[0] == kind for d in drafts) < count:
            draft = _draft(rng, elements, kind, used)
            if draft is None:
                continue
            used.update((n, _field(kind)) for n in draft[5])
            drafts.append((kind, *draft[:5]))
    rng.shuffle(drafts)
    return [
        CounterfactualQuestion(
            f"c{i:04d}", kind, text, answers, docs, "heldout" if i % 2 else "tune", edits, memory
        )
        for i, (kind, text, answers, memory, docs, edits) in enumerate(drafts)
    ]


def freeze(path: Path = FROZEN, seed: int = SEED) -> None:
    write_frozen(path, seed, build(seed))


if __name__ == "__main__":
    freeze()
    print(describe(load()))
