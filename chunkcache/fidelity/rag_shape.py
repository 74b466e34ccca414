"""Real-shape RAG questions (issue 56): 4-16 long, alike documents, answers over one to three.

Shared by benchmarks/bench_rag_shape.py (and, later, `chunkcache calibrate`); the set is drawn and
frozen by benchmarks/rag_shape_set.py into chunkcache/data/rag_shape_questions.json, so that an
installed package has it.

A document is one element of the `mendeleev` package's database (nobody on this project wrote any
of it), rendered by fixed rules: a title line, the package's description / uses / sources / name
origin texts verbatim, then its properties as "Label: value unit" lines (labels and units from the
database's `propertymetadata` table; the asked properties first), then its isotopes, ionization
energies and oxidation states. A document of size S (300, 500, 1000) holds those lines in that
order until its estimated token count (`estimate`, tokenizer-free so that the documents are the
same for every model) reaches S; the smaller sizes are prefixes of the larger.

The asked facts are counterfactual: in an asked document, the value is replaced at every
occurrence by a perturbed one (and, for comparisons, so that the real values would give another
answer than the document's), which no other document of the prompt holds. The edits and their
counts per size are frozen with the questions and checked whenever a document is built.

Answers are checked by rules (`score`):
- a number: a number of the reply equals the expected one (the document's digits, "1,811.15" read
  as 1811.15, trailing zeros ignored), or is it rounded to fewer decimals keeping >= 3
  significant digits ("1811" or "1811.2" for 1811.15; "7.9" for 7.87 is not enough);
- a name among the question's choices: the first of the choices that the reply names;
- a count: the first count in the reply (a digit 0-3 not part of a longer number nor an "atomic
  number N" of a title restated, or zero / none / one / two / three / all).
A question is correct when every expected value is there; `facts` is the share of them stated.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sqlite3
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from chunkcache.fidelity.questions import checked, fingerprint

_DATA = Path(__file__).resolve().parents[1] / "data"
FROZEN = _DATA / "rag_shape_questions.json"
SIZES = (300, 500, 1000)
KINDS = ("one", "two", "three", "free")
# The asked properties: (table, column) -> how a question names it. First in every document.
ASKED = {
    "atomic_weight": ("elements", "atomic weight"),
    "density": ("elements", "density"),
    "melting_point": ("phasetransitions", "melting point"),
    "boiling_point": ("phasetransitions", "boiling point"),
    "discovery_year": ("elements", "discovery year"),
}
_TEXTS = (("description", ""), ("uses", "Uses: "), ("sources", "Sources: "), ("name_origin", "Name origin: "))
# Columns never rendered: the texts (rendered above), identifiers of the title, colours, internal ids.
_SKIP = {
    *(name for name, _ in _TEXTS),
    *("name", "symbol", "atomic_number", "cpk_color", "jmol_color", "molcas_gv_color", "id"),
    *("group_id", "series_id", "allotrope", "is_sublimation_point", "is_transition", "discovery_year"),
}
_WORDS = {"zero": 0, "none": 0, "no": 0, "one": 1, "two": 2, "three": 3, "all": 3}


@dataclass(frozen=True)
class Record:
    """One element's document material: the title and its lines, in rendering order."""

    number: int
    name: str
    symbol: str
    lines: tuple[str, ...]
    values: dict[str, str]  # asked property -> its rendered value (as the document shows it)

    def document(self, size: int) -> str:
        """The title, then lines while the estimated tokens stay below `size`."""
        out = [f"{self.name} ({self.symbol}, atomic number {self.number})"]
        total = estimate(out[0])
        for line in self.lines:
            if total >= size:
                break
            out.append(line)
            total += estimate(line)
        return "\n".join(out) + "\n"


@dataclass(frozen=True)
class Edit:
    """In document `doc_id`, property `field`'s value `old` replaced by `new`, at counts[size]
    places of the document of that size."""

    doc_id: int
    field: str
    old: str
    new: str
    counts: dict[str, int]


@dataclass(frozen=True)
class RagQuestion:
    qid: str
    kind: str  # one | two | three | free
    form: str  # value | values | higher | highest | count | compare
    field: str  # the asked property (ASKED)
    question: str
    answers: list[list[str]]  # groups, every one needed; a group's alternatives are equivalent
    choices: list[str]  # names a higher / highest reply chooses from (empty for the other forms)
    memory: list[list[str]]  # the real values: a reply holding them answered from memory
    doc_ids: list[int]  # atomic numbers, in prompt order
    split: str  # tune | heldout
    edits: list[Edit] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.doc_ids)

    def documents(self, records: dict[int, Record], size: int) -> list[str]:
        """The prompt's documents of `size`, in order, the asked ones edited (checked)."""
        docs = {n: records[n].document(size) for n in self.doc_ids}
        for e in self.edits:
            docs[e.doc_id] = apply(docs[e.doc_id], e, size)
        return [docs[n] for n in self.doc_ids]


def estimate(text: str) -> float:
    """Tokens as a BPE tokenizer that splits digits counts them, roughly: a digit, a word, a
    punctuation mark each one, times 1.27 (the mean ratio of SmolLM2's and Qwen2.5's counts to
    those pieces on these documents; their counts per size are in benchmarks/history/
    RESULTS-narrative.md "bench_rag_shape: the real RAG shape")."""
    return 1.27 * len(re.findall(r"\d|[^\W\d_]+|[^\w\s]", text))


def number_pattern(value: str) -> str:
    """`value` as a whole number: not inside a longer one ("7.87" not in "17.87" or "7.875")."""
    return rf"(?<![\d.]){re.escape(value)}(?!\.?\d)"


def occurrences(value: str, text: str) -> int:
    return len(re.findall(number_pattern(value), text))


def apply(doc: str, edit: Edit, size: int) -> str:
    """`doc` with the edit made everywhere; raises where the package's data no longer matches the
    frozen edit (another count of the old value)."""
    text, n = re.subn(number_pattern(edit.old), edit.new, doc)
    if n == 0 or n != edit.counts[str(size)]:
        raise ValueError(
            f"edit {edit} does not apply to document {edit.doc_id} of size {size} ({n} replaced)"
        )
    return text


# ---- rendering the database ---------------------------------------------------------------------


def fmt(value: Any) -> str:
    """A value as the documents show it: at most 6 significant digits, no float noise."""
    if isinstance(value, float):
        text = f"{value:.6g}"
        return text if "e" not in text else f"{value:.3g}"
    return str(value)


def _db() -> sqlite3.Connection:
    spec = importlib.util.find_spec("mendeleev")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError("the real-shape RAG questions read the `mendeleev` package's database")
    return sqlite3.connect(f"file:{Path(spec.origin).with_name('elements.db')}?mode=ro", uri=True)


def _labels(db: sqlite3.Connection) -> dict[tuple[str, str], str]:
    """(table, column) -> "Label" or "Label (unit)" from propertymetadata, first row wins."""
    out: dict[tuple[str, str], str] = {}
    for table, column, desc, unit in db.execute(
        "select table_name, column_name, description, unit from propertymetadata order by id"
    ):
        desc = " ".join(desc.split())
        if len(desc) > 60:  # a sentence, not a label (the supply-risk columns): the column's name
            desc = column.replace("_", " ").capitalize()
        out.setdefault((table, column), desc + (f" ({unit})" if unit else ""))
    out[("elements", "discovery_year")] = "Discovery year"
    return out


def _line(label: str, value: Any) -> str:
    if label.startswith("Is the ") and value in (0, 1):
        value = "yes" if value else "no"
    if label.endswith(")"):  # "Density at 295K (g/cm^3)" -> "Density at 295K: 7.87 g/cm^3"
        label, unit = label[:-1].rsplit(" (", 1)
        return f"{label}: {fmt(value)} {unit}"
    return f"{label}: {fmt(value)}"


def _rows(db: sqlite3.Connection, table: str, order: str = "") -> dict[int, list[dict[str, Any]]]:
    cur = db.execute(f"select * from {table} {order}")
    names = [d[0] for d in cur.description]
    out: dict[int, list[dict[str, Any]]] = {}
    for row in cur:
        rec = dict(zip(names, row, strict=True))
        out.setdefault(rec["atomic_number"], []).append(rec)
    return out


def _isotope(symbol: str, iso: dict[str, Any]) -> str:
    parts = [f"mass {fmt(iso['mass'])} Da"]
    if iso["abundance"] is not None:
        parts.append(f"abundance {fmt(iso['abundance'])}%")
    if iso["half_life"] is not None:
        parts.append(f"half-life {fmt(iso['half_life'])} {iso['half_life_unit']}")
    elif not iso["is_radioactive"]:
        parts.append("stable")
    return f"Isotope {symbol}-{iso['mass_number']}: " + ", ".join(parts)


def _tables(el: dict[str, Any], iso: list[dict], ion: list[dict], ox: list[dict]) -> list[str]:
    isotopes = [i for i in iso if i["abundance"] is not None or i["half_life"] is not None]
    isotopes.sort(key=lambda i: (i["abundance"] is None, i["mass_number"]))
    lines = [_isotope(el["symbol"], i) for i in isotopes]
    lines += [f"Ionization energy {i['species_name']}: {fmt(i['ionization_energy'])} eV" for i in ion]
    states = sorted(o["oxidation_state"] for o in ox)
    if states:
        main = sorted(o["oxidation_state"] for o in ox if o["category"] == "main")
        lines.append(
            "Oxidation states: " + ", ".join(f"{s:+d}" if s else "0" for s in states)
            + (f" (main: {', '.join(f'{s:+d}' for s in main)})" if main else "")
        )  # fmt: skip
    return lines


def _record(el: dict[str, Any], phase: list[dict], tables: list[str], labels: dict) -> Record:
    texts = [prefix + " ".join(el[name].split()) for name, prefix in _TEXTS if el.get(name)]
    # Elements with allotropes (several phase rows) show none of them: one value per property.
    pt = phase[0] if len(phase) == 1 else {}
    values = {}
    for col, (table, _) in ASKED.items():
        v = (el if table == "elements" else pt).get(col)
        if v is not None and "e" not in fmt(v):
            values[col] = fmt(v)
    asked = [_line(labels[(ASKED[c][0], c)], v) for c, v in values.items()]
    if el.get("discoverers"):
        asked.append(f"Discoverers: {' '.join(el['discoverers'].split())}")
    rest = [
        _line(labels[(t, col)], v)
        for t, row in (("elements", el), ("phasetransitions", pt))
        for col, v in row.items()
        if v is not None and v != "" and col not in _SKIP and col not in values and (t, col) in labels
        and col not in ("discoverers",)
    ]  # fmt: skip
    return Record(el["atomic_number"], el["name"], el["symbol"], tuple(texts + asked + rest + tables), values)


@cache
def load_records() -> dict[int, Record]:
    """Every element's document material, from the `mendeleev` package's database."""
    db = _db()
    labels = _labels(db)
    elements = {n: rows[0] for n, rows in _rows(db, "elements").items()}
    phase = _rows(db, "phasetransitions", "order by id")
    iso = _rows(db, "isotopes", "order by id")
    ion = _rows(db, "ionizationenergies", "order by ion_charge")
    ox = _rows(db, "oxidationstates", "order by id")
    out = {}
    for n, el in elements.items():
        tables = _tables(el, iso.get(n, []), ion.get(n, []), ox.get(n, []))
        out[n] = _record(el, phase.get(n, []), tables, labels)
    return out


def pool(records: dict[int, Record]) -> list[int]:
    """The elements whose documents reach the largest size (every document of a prompt does)."""
    return sorted(n for n, r in records.items() if estimate(r.document(10**6)) >= max(SIZES))


# ---- checking replies ----------------------------------------------------------------------------


def _numbers(reply: str) -> list[str]:
    return [m.replace(",", "") for m in re.findall(r"(?<![\w.])\d[\d,]*(?:\.\d+)?", reply)]


def _decimals(value: str) -> int:
    return len(value.split(".")[1]) if "." in value else 0


def number_matches(said: str, expected: str) -> bool:
    """`said` is `expected`, or it rounded to fewer decimals with >= 3 significant digits."""
    if float(said) == float(expected):
        return True
    d = _decimals(said)
    significant = len(said.replace(".", "").lstrip("0"))
    return d < _decimals(expected) and significant >= 3 and round(float(expected), d) == float(said)


def stated(reply: str, value: str) -> bool:
    return any(number_matches(s, value) for s in _numbers(reply))


def chosen(reply: str, choices: list[str]) -> str | None:
    """The first of `choices` the reply names (whole word, any case)."""
    found = [(m.start(), c) for c in choices if (m := re.search(rf"\b{re.escape(c)}\b", reply, re.I))]
    return min(found)[1] if found else None


def count_said(reply: str) -> int | None:
    reply = re.sub(r"atomic number \d+", "", reply)  # a document's title restated is no count
    m = re.search(r"(?<![\d.])([0-3])(?![\d.]\d?)|\b(zero|none|no|one|two|three|all)\b", reply, re.I)
    if m is None:
        return None
    return int(m.group(1)) if m.group(1) else _WORDS[m.group(2).lower()]


def facts(q: RagQuestion, reply: str, groups: list[list[str]] | None = None) -> list[bool]:
    """Per expected group (the answers, or `groups`, e.g. the memory values): stated or not."""
    groups = q.answers if groups is None else groups
    if q.form in ("higher", "highest"):
        return [chosen(reply, q.choices) in g for g in groups]
    if q.form == "count":
        return [str(count_said(reply)) in g for g in groups]
    return [any(stated(reply, v) for v in g) for g in groups]


def score(q: RagQuestion, reply: str) -> tuple[bool, float]:
    """(correct, share of the expected facts stated)."""
    hits = facts(q, reply)
    return all(hits), sum(hits) / len(hits)


# ---- the frozen file ------------------------------------------------------------------------------


def from_json(raw: dict[str, Any]) -> RagQuestion:
    return RagQuestion(**{**raw, "edits": [Edit(**e) for e in raw["edits"]]})


def load(path: Path = FROZEN) -> list[RagQuestion]:
    data = json.loads(path.read_text())
    return checked(path, data, [from_json(q) for q in data["questions"]])


__all__ = [
    "ASKED",
    "FROZEN",
    "KINDS",
    "SIZES",
    "Edit",
    "RagQuestion",
    "Record",
    "apply",
    "estimate",
    "fingerprint",
    "load",
    "load_records",
    "occurrences",
    "pool",
    "score",
]
