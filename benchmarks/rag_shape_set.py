"""The real-shape RAG question set (issue 56): drawn once by fixed rules with a fixed seed, frozen.

Documents, edits, the answer check and the frozen file are the package's
(chunkcache/fidelity/rag_shape.py). Here the questions are drawn, for N = 4, 8 and 16 documents per
prompt (every document an element of the pool, the asked ones among them; the same questions
serve every document size, whose smaller documents are prefixes of the larger):

- one: the value of a property in one document ("What is the density of X?");
- two: alternately which of two has the higher value (a name) or both values;
- three: alternately which of three has the highest value (a name) or how many of three lie above a
  threshold (a count);
- free: one or two sentences comparing a property of two elements, scored by the two values stated.

The asked properties (ASKED: atomic weight, density, melting and boiling point, discovery year)
rotate per question, the same way in both halves. Each asked value is replaced in its document by a perturbed one (x0.6-0.87 or
x1.15-1.6, the document's decimals; a year moved by 7-60 years), redrawn until the document's
values give another answer than the real ones (for higher / highest / count: memory answers wrong)
with a clear margin (10%, or 10 years), and until no document of the prompt holds the new value.
Per N and type 16 questions, tune and held-out in alternate pairs (so that each half has both
forms of a type), frozen before any mode ran.

`paraphrased` asks the same questions in other words than the documents' (`--wording paraphrase` of
bench_rag_shape and excerpt_recall), by fixed rules written before any mode ran on them.

    python benchmarks/rag_shape_set.py   # rewrites chunkcache/data/rag_shape_questions.json
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from pathlib import Path

from fidelity_set import write_frozen

from chunkcache.fidelity.rag_shape import (
    ASKED,
    FROZEN,
    KINDS,
    SIZES,
    Edit,
    RagQuestion,
    Record,
    fingerprint,
    load,
    load_records,
    occurrences,
    pool,
)

__all__ = ["FROZEN", "build", "describe", "freeze", "load", "paraphrased", "worded"]

SEED = 56
NS = (4, 8, 16)
PER_KIND = 16  # per N and type: 8 tune, 8 held-out
FIELDS = tuple(ASKED)
# For "how many of X, Y and Z ...": the threshold and its unit.
THRESHOLDS = {
    "atomic_weight": (100.0, "Da"),
    "density": (5.0, "g/cm^3"),
    "melting_point": (1000.0, "K"),
    "boiling_point": (2000.0, "K"),
    "discovery_year": (1800.0, ""),
}
_FORMS = {"one": ("value",), "two": ("higher", "values"), "three": ("highest", "count"), "free": ("compare",)}
_YEAR = "discovery_year"


def _plural(field: str) -> str:
    return {"density": "densities"}.get(field, ASKED[field][1] + "s")


def _names(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + f" and {names[-1]}"


def question_text(form: str, field: str, names: list[str]) -> str:
    label, who = ASKED[field][1], _names(names)
    year = field == _YEAR
    if form == "value":
        return f"In what year was {who} discovered?" if year else f"What is the {label} of {who}?"
    if form == "values":
        return f"In what years were {who} discovered?" if year else f"What are the {_plural(field)} of {who}?"
    if form == "higher":
        which = "was discovered earlier" if year else f"has the higher {label}"
        return f"Which {which}, {names[0]} or {names[1]}?"
    if form == "highest":
        which = "was discovered earliest" if year else f"has the highest {label}"
        return f"Which of {who} {which}?"
    if form == "count":
        limit, unit = THRESHOLDS[field]
        what = f"were discovered before {limit:.0f}" if year else f"have a {label} above {limit:g} {unit}"
        return f"How many of {who} {what}?"
    what = (
        f"when {who} were discovered, stating both years"
        if year
        else f"the {_plural(field)} of {who}, stating both values"
    )
    return f"In one or two sentences, compare {what}."


# The same questions in other words (`paraphrase`): no word of a document's line for the asked
# property ("Relative atomic weight", "Density at 295K", "Melting point", "Boiling point",
# "Discovery year", units), so that the joint stream's excerpts (engine/excerpt.py), which find
# facts by the question's words, are tried where words cannot find them. Written before any mode
# ran on them: (a property, a comparative, a superlative, a threshold's verb phrase).
_OTHER_WORDS = {
    "atomic_weight": ("how heavy {who} is", "in daltons", "is heavier", "is the heaviest",
                      "weigh more than {limit} daltons"),
    "density": ("how many grams a cubic centimetre of {who} weighs", "", "is denser", "is the densest",
                "are denser than {limit} grams per cubic centimetre"),
    "melting_point": ("at what temperature {who} turns liquid", "in kelvin", "turns liquid at a higher temperature",
                      "turns liquid at the highest temperature", "stay solid above {limit} kelvin"),
    "boiling_point": ("at what temperature {who} vaporizes", "in kelvin", "vaporizes at a higher temperature",
                      "vaporizes at the highest temperature", "vaporize only above {limit} kelvin"),
    "discovery_year": ("when {who} was first identified", "", "was identified earlier", "was identified first",
                       "were identified before {limit}"),
}  # fmt: skip


def paraphrase_text(form: str, field: str, names: list[str]) -> str:
    """`question_text`'s question in `_OTHER_WORDS`: the same answer, none of the document's words
    for the property."""
    what, unit, more, most, above = _OTHER_WORDS[field]
    unit = f", {unit}" if unit else ""
    if form == "value":
        return f"Tell me {what.format(who=_names(names))}{unit}."
    if form == "values":
        return f"Tell me {what.format(who=names[0])}, and the same for {_names(names[1:])}{unit}."
    if form == "higher":
        return f"Which {more}, {names[0]} or {names[1]}?"
    if form == "highest":
        return f"Which of {_names(names)} {most}?"
    if form == "count":
        return f"How many of {_names(names)} {above.format(limit=f'{THRESHOLDS[field][0]:g}')}?"
    both = " and ".join(what.format(who=n) for n in names)
    return f"In one or two sentences, tell me {both}, stating both figures."


def paraphrased(q: RagQuestion, records: dict[int, Record]) -> RagQuestion:
    """`q` asked by `paraphrase_text` (the asked elements in the question's order: its edits')."""
    names = [records[e.doc_id].name for e in q.edits]
    return replace(q, question=paraphrase_text(q.form, q.field, names))


WORDINGS = ("frozen", "paraphrase")
WORDING_HELP = "the frozen questions, or the same in other words (rag_shape_set.paraphrase_text)"


def worded(questions: list[RagQuestion], records: dict[int, Record], wording: str) -> list[RagQuestion]:
    return questions if wording == "frozen" else [paraphrased(q, records) for q in questions]


def _key(field: str, value: str) -> float:
    """Larger = the answer of higher / highest (for years: earlier)."""
    return -float(value) if field == _YEAR else float(value)


def _apart(field: str, a: float, b: float) -> bool:
    """A clear margin: 10 years, or 10% of the larger value."""
    return abs(a - b) >= 10 if field == _YEAR else abs(a - b) >= 0.1 * max(abs(a), abs(b))


def _perturb(rng: random.Random, field: str, old: str) -> str:
    if field == _YEAR:
        return str(min(2010, int(old) + rng.choice((-1, 1)) * rng.randint(7, 60)))
    factor = rng.uniform(0.6, 0.87) if rng.random() < 0.5 else rng.uniform(1.15, 1.6)
    decimals = len(old.split(".")[1]) if "." in old else 0
    return f"{float(old) * factor:.{decimals}f}"


def _best(field: str, values: list[str]) -> int:
    return max(range(len(values)), key=lambda i: _key(field, values[i]))


def _count(field: str, values: list[str]) -> int:
    limit = THRESHOLDS[field][0]
    return sum(_key(field, v) > _key(field, str(limit)) for v in values)


def _answers_differ(form: str, field: str, old: list[str], new: list[str]) -> bool:
    """The document's values answer otherwise than the real ones, clearly (else redraw)."""
    nums = [float(v) for v in new]
    if form in ("higher", "highest"):
        ranked = sorted(nums, key=lambda v: _key(field, str(v)), reverse=True)
        return _best(field, new) != _best(field, old) and _apart(field, ranked[0], ranked[1])
    if form == "count":
        limit = THRESHOLDS[field][0]
        return _count(field, new) != _count(field, old) and all(_apart(field, v, limit) for v in nums)
    return True


def _edits(rng, records, docs, targets, field, form) -> list[Edit] | None:
    """Perturbed values for the targets (at most 50 tries), or None."""
    texts = [records[n].document(max(SIZES)) for n in docs]
    old = [records[n].values[field] for n in targets]
    for _ in range(50):
        new = [_perturb(rng, field, v) for v in old]
        fresh = all(not any(occurrences(v, t) for t in texts) for v in new) and len(set(new)) == len(new)
        if (
            fresh
            and all(a != b for a, b in zip(old, new, strict=True))
            and _answers_differ(form, field, old, new)
        ):
            return [
                Edit(n, field, o, v, {str(s): occurrences(o, records[n].document(s)) for s in SIZES})
                for n, o, v in zip(targets, old, new, strict=True)
            ]
    return None


def _expected(form: str, field: str, names: list[str], values: list[str]) -> list[list[str]]:
    if form in ("higher", "highest"):
        return [[names[_best(field, values)]]]
    if form == "count":
        return [[str(_count(field, values))]]
    return [[v] for v in values]


def _askable(records: dict[int, Record], members: list[int], field: str) -> list[int]:
    """Elements with the property, stated in even the smallest document."""
    return [
        n for n in members
        if field in records[n].values and occurrences(records[n].values[field], records[n].document(min(SIZES)))
    ]  # fmt: skip


def _draft(rng, records, members, n_docs, kind, form, field) -> tuple | None:
    hops = {"one": 1, "two": 2, "three": 3, "free": 2}[kind]
    targets = rng.sample(_askable(records, members, field), hops)
    old = [records[t].values[field] for t in targets]
    if hops > 1 and not all(_apart(field, float(a), float(b)) for a in old for b in old if a != b):
        return None  # the real values too close: memory's answer would not be clearly apart
    docs = targets + rng.sample([m for m in members if m not in targets], n_docs - hops)
    rng.shuffle(docs)
    edits = _edits(rng, records, docs, targets, field, form)
    if edits is None:
        return None
    names = [records[t].name for t in targets]
    new = [e.new for e in edits]
    choices = names if form in ("higher", "highest") else []
    return (form, field, question_text(form, field, names), _expected(form, field, names, new), choices,
            _expected(form, field, names, old), docs, edits)  # fmt: skip


def build(seed: int = SEED) -> list[RagQuestion]:
    records = load_records()
    members = pool(records)
    rng = random.Random(seed)
    questions = []
    for n_docs in NS:
        for kind in KINDS:
            for i in range(PER_KIND):
                # Tune and held-out in alternate pairs, the j-th of its half: both halves get the
                # same forms (alternating) and properties (rotating, from a per-type offset).
                j, forms = (i // 4) * 2 + i % 2, _FORMS[kind]
                form = forms[j % len(forms)]
                field = FIELDS[(j // len(forms) + KINDS.index(kind)) % len(FIELDS)]
                draft = None
                while draft is None:
                    draft = _draft(rng, records, members, n_docs, kind, form, field)
                form, field, text, answers, choices, memory, docs, edits = draft
                split = "tune" if (i // 2) % 2 == 0 else "heldout"
                qid = f"n{n_docs:02d}-{kind}-{i:02d}"
                questions.append(
                    RagQuestion(qid, kind, form, field, text, answers, choices, memory, docs, split, edits)
                )
    return questions


def freeze(path: Path = FROZEN, seed: int = SEED) -> None:
    write_frozen(path, seed, build(seed))


def describe(questions: list[RagQuestion]) -> str:
    cells = Counter((q.n, q.kind, q.split) for q in questions)
    rows = ", ".join(f"N={n} {k} {s}: {c}" for (n, k, s), c in sorted(cells.items()))
    return f"{len(questions)} questions, fingerprint {fingerprint(questions)}: {rows}"


if __name__ == "__main__":
    freeze()
    print(describe(load()))
