"""The built-in fidelity questions: real encyclopedic text, frozen questions, checked answers.

Shared by `chunkcache calibrate` (its prompt set when the user gives none) and the fidelity
benchmark (benchmarks/fidelity_set.py and counterfactual_set.py draw and freeze the sets; the
frozen files live here, in chunkcache/data/, so that an installed package has them).

The document texts are not copied: they are read at run time from the `mendeleev` package's
database (118 elements, three short encyclopedic texts each; nobody on this project wrote any of
it). A counterfactual question's document has one fact replaced by another element's real value,
so that only reading the document, not memory, gives the answer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import re
import sqlite3
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_DATA = Path(__file__).resolve().parents[1] / "data"
ORIGINAL = _DATA / "fidelity_questions.json"
COUNTERFACTUAL = _DATA / "counterfactual_questions.json"


@dataclass(frozen=True)
class Element:
    number: int
    name: str
    symbol: str
    text: str  # description, uses and sources, verbatim
    year: int | None
    discoverers: str | None

    def document(self) -> str:
        return f"{self.name} ({self.symbol}, atomic number {self.number})\n{self.text}\n"


@dataclass(frozen=True)
class Question:
    qid: str
    kind: str  # symbol | number | year | discoverer | two_symbols | two_numbers
    question: str
    # Every group must be matched; within a group any alternative counts.
    answers: list[list[str]]
    doc_ids: list[int]  # atomic numbers, in prompt order
    split: str  # "tune" | "heldout"

    @property
    def hops(self) -> int:
        return 2 if self.kind.startswith("two_") else 1

    def documents(self, elements: dict[int, Element]) -> list[str]:
        """The prompt's documents, in order (a counterfactual question edits one or two)."""
        return [elements[n].document() for n in self.doc_ids]


@dataclass(frozen=True)
class Edit:
    """In document `doc_id`, fact `field` changed from `old` to `new` at `count` places."""

    doc_id: int
    field: str  # symbol | number | year | discoverer
    old: str
    new: str
    count: int


@dataclass(frozen=True)
class CounterfactualQuestion(Question):
    edits: list[Edit]
    memory: list[list[str]]  # the real values: a reply holding them answered from memory

    def documents(self, elements: dict[int, Element]) -> list[str]:
        edited = dict(elements)
        for e in self.edits:
            edited[e.doc_id] = apply(edited[e.doc_id], e)
        return [edited[n].document() for n in self.doc_ids]


def _mendeleev_db() -> Path:
    """The package's database, found without importing it (its import pulls in pandas)."""
    spec = importlib.util.find_spec("mendeleev")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "the built-in fidelity questions read their documents from the `mendeleev` package: "
            "pip install 'chunkcache[calibrate]' (or give your own prompts)"
        )
    return Path(spec.origin).with_name("elements.db")


def load_elements(export: Path | None = None) -> dict[int, Element]:
    """The elements from the `mendeleev` package, or from a JSON `export` of them (written by
    benchmarks/fidelity_set.py's `export_elements`) on a machine without it."""
    if export is not None:
        return {int(k): Element(**v) for k, v in json.loads(export.read_text()).items()}
    rows = sqlite3.connect(f"file:{_mendeleev_db()}?mode=ro", uri=True).execute(
        "select atomic_number, name, symbol, description, uses, sources, discovery_year, discoverers "
        "from elements order by atomic_number"
    )
    out = {}
    for number, name, symbol, desc, uses, sources, year, disc in rows:
        text = " ".join(t.strip() for t in (desc, uses, sources) if t and t.strip())
        if len(text.split()) >= 20:
            out[number] = Element(number, name, symbol, text, year, disc)
    return out


def correct(reply: str, answers: list[list[str]]) -> bool:
    """Every answer group has an alternative in the reply as a whole word (case-sensitive for
    symbols and numbers, which are short: "O" must not match "of")."""
    return all(any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", reply) for a in group) for group in answers)


def _pattern(field: str, value: str) -> str:
    if field == "symbol":  # "Sn" in "SnO2" and "33%Sn" too, not in "Snow"
        return rf"(?<![A-Za-z]){re.escape(value)}(?![a-z])"
    if field in ("number", "year"):
        return rf"(?<!\d){re.escape(value)}(?!\d)"
    return rf"(?<!\w){re.escape(value)}(?!\w)"


def occurrences(field: str, value: str, text: str) -> int:
    return len(re.findall(_pattern(field, value), text))


def apply(el: Element, edit: Edit) -> Element:
    """`el` with the edit made everywhere in its document; raises if the package's text no longer
    matches the frozen edit (another count of the old value, or a leftover)."""
    text, n = re.subn(_pattern(edit.field, edit.old), edit.new, el.text)
    if edit.field == "symbol":
        new = dataclasses.replace(el, symbol=edit.new, text=text)
        n += 1  # the title line
    elif edit.field == "number":
        new = dataclasses.replace(el, number=int(edit.new), text=text)
        n += 1
    elif edit.field == "year":
        new = dataclasses.replace(el, year=int(edit.new), text=text)
    elif edit.field == "discoverer":
        new = dataclasses.replace(el, discoverers=edit.new, text=text)
    else:
        raise ValueError(f"edit of {el.name}: unknown field {edit.field!r}")
    if n == 0 or n != edit.count or occurrences(edit.field, edit.old, new.document()):
        raise ValueError(f"edit {edit} does not apply to {el.name}'s text ({n} replaced)")
    return new


def fingerprint(questions: list[Any]) -> str:
    blob = json.dumps([asdict(q) for q in questions], sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def checked(path: Path, data: dict[str, Any], questions: list[Any]) -> list[Any]:
    """`questions` read from the frozen file `path` (its JSON `data`), refused if they are not
    what was frozen."""
    if fingerprint(questions) != data["fingerprint"]:
        raise ValueError(f"{path} was edited after it was frozen (fingerprint mismatch)")
    return questions


def load_original(path: Path = ORIGINAL) -> list[Question]:
    data = json.loads(path.read_text())
    return checked(path, data, [Question(**q) for q in data["questions"]])


def load_counterfactual(path: Path = COUNTERFACTUAL) -> list[CounterfactualQuestion]:
    data = json.loads(path.read_text())
    questions = [
        CounterfactualQuestion(**{**q, "edits": [Edit(**e) for e in q["edits"]]}) for q in data["questions"]
    ]
    return checked(path, data, questions)
