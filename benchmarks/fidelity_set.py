"""The fidelity benchmark's question set: real encyclopedic text from the `mendeleev` package.

`mendeleev` (PyPI, offline) ships a database of the 118 elements with three short encyclopedic
texts each (description, uses, sources) and structured facts. A document is one element: a title
line made of the package's own fields (name, symbol, atomic number) and its three texts verbatim;
nobody on this project wrote any of it. Questions are templates over the package's facts, kept
only where the answer is in the document (`answer_in_doc`):

- single: the answer is in one of 3-5 documents: symbol, atomic number, discovery year (when the
  year is in the text), discoverer (when a discoverer's surname is in the text);
- double: the answer needs two documents: the symbols, or the atomic numbers, of two elements.

The set is drawn once with a fixed seed and frozen in `chunkcache/data/fidelity_questions.json`
(element ids, document order, question, answers, split) before any reuse mode was run on it; the
document texts are read from the package at run time. Half of the questions are held out: tune on "tune", report
the default's claim on "heldout".
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import asdict
from pathlib import Path

# The question types, the text loader, the answer check and the frozen file are the package's
# (chunkcache/fidelity/questions.py), which `chunkcache calibrate` asks too; drawing stays here.
from chunkcache.fidelity.questions import ORIGINAL as FROZEN
from chunkcache.fidelity.questions import Element, Question, correct, fingerprint, load_elements
from chunkcache.fidelity.questions import load_original as load

__all__ = ["FROZEN", "Element", "Question", "correct", "fingerprint", "load", "load_elements"]


def _surnames(el: Element) -> list[str]:
    if not el.discoverers or "ancient" in el.discoverers.lower():
        return []
    names = {w for w in re.findall(r"[A-Z][a-z]{2,}", el.discoverers)}
    return sorted(n for n in names if re.search(rf"\b{n}\b", el.text))


def _single(el: Element) -> list[tuple[str, str, list[list[str]]]]:
    qs = [
        ("symbol", f"What is the chemical symbol of {el.name}?", [[el.symbol]]),
        ("number", f"What is the atomic number of {el.name}?", [[str(el.number)]]),
    ]
    if el.year and str(el.year) in el.text:
        qs.append(("year", f"In what year was {el.name} discovered?", [[str(el.year)]]))
    if surnames := _surnames(el):
        qs.append(("discoverer", f"Who discovered {el.name}?", [surnames]))
    return qs


def build(seed: int = 15) -> list[Question]:
    elements = load_elements()
    ids = sorted(elements)
    rng = random.Random(seed)
    drafts: list[tuple[str, str, list[list[str]], list[int]]] = []
    for number in ids:
        for kind, text, answers in _single(elements[number]):
            drafts.append((kind, text, answers, [number]))
    pairs = set()
    while len(pairs) < 90:
        a, b = rng.sample(ids, 2)
        pairs.add((min(a, b), max(a, b)))
    for i, (a, b) in enumerate(sorted(pairs)):
        ea, eb = elements[a], elements[b]
        if i % 2:
            drafts.append(
                ("two_symbols", f"What are the chemical symbols of {ea.name} and {eb.name}?",
                 [[ea.symbol], [eb.symbol]], [a, b])
            )  # fmt: skip
        else:
            drafts.append(
                ("two_numbers", f"What are the atomic numbers of {ea.name} and {eb.name}?",
                 [[str(a)], [str(b)]], [a, b])
            )  # fmt: skip
    questions = []
    rng.shuffle(drafts)
    for i, (kind, text, answers, needed) in enumerate(drafts):
        total = rng.randint(3, 5)
        others = rng.sample([n for n in ids if n not in needed], total - len(needed))
        docs = needed + others
        rng.shuffle(docs)
        split = "heldout" if i % 2 else "tune"
        questions.append(Question(f"q{i:04d}", kind, text, answers, docs, split))
    return questions


def export_elements(path: Path) -> None:
    path.write_text(json.dumps({n: asdict(e) for n, e in load_elements().items()}))


def freeze(path: Path = FROZEN, seed: int = 15) -> None:
    write_frozen(path, seed, build(seed))


def write_frozen(path: Path, seed: int, questions: list) -> None:
    """Freeze a drawn question set: its seed, its fingerprint and the questions, as JSON."""
    payload = {
        "seed": seed,
        "fingerprint": fingerprint(questions),
        "questions": [asdict(q) for q in questions],
    }
    path.write_text(json.dumps(payload, indent=0))


def describe(questions: list) -> str:
    kinds = Counter(q.kind for q in questions)
    return f"{len(questions)} questions, fingerprint {fingerprint(questions)}: {dict(kinds)}"


if __name__ == "__main__":
    freeze()
    print(describe(load()))
