"""Calibration prompts: the user's JSONL file, or the built-in questions: the fidelity benchmark's
(3-5 short documents, one fact asked) and the real RAG shape's (`rag_shape`: 8 alike documents of
~500 tokens, questions over one to three of them or free-form), so that a profile made on the
built-in set reflects the shape a retriever sends (issue 56).

A line of the file is `{"documents": ["...", ...], "question": "...", "answers": [...],
"system": "..."}` (answers and system optional). `answers` is a list of strings (any one in the
reply counts) or a list of lists (every inner list needs one in the reply). A line that is not
valid is reported with its number and skipped: one bad line does not waste a long run.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from chunkcache.fidelity import questions as fq
from chunkcache.fidelity import rag_shape as rs
from chunkcache.fidelity.measure import SYSTEM

_FIELDS = {"documents", "question", "answers", "system"}
T = TypeVar("T")


@dataclass(frozen=True)
class CalibrationPrompt:
    documents: tuple[str, ...]
    question: str
    answers: tuple[tuple[str, ...], ...] | None  # groups; None = compare with full prefill's reply
    system: str = SYSTEM
    # A real-shape question: scored by its own rules (`rag_shape.score`: numbers as numbers, the
    # name a comparison chooses, every fact of a free-form answer), not by words in the reply.
    rag: rs.RagQuestion | None = None
    reply_tokens: int = 0  # the reply length it needs at least (a free-form answer's), else the run's

    def tokens(self, max_tokens: int) -> int:
        """The reply length this prompt is measured with: the run's, or longer where it needs."""
        return max(max_tokens, self.reply_tokens)

    def key(self, max_tokens: int) -> str:
        """What identifies this prompt's results in the resume file (the reply length included)."""
        body = [list(self.documents), self.question, self.answers, self.system, max_tokens]
        return hashlib.sha256(json.dumps(body).encode()).hexdigest()[:24]

    def correct(self, reply: str) -> bool | None:
        if self.rag is not None:
            return rs.score(self.rag, reply)[0]
        if self.answers is None:
            return None
        return fq.correct(reply, [list(g) for g in self.answers])


def _strings(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, str) and v.strip() for v in value)


def _answers(value: Any) -> tuple[tuple[str, ...], ...]:
    if _strings(value):
        return (tuple(value),)
    if isinstance(value, list) and value and all(_strings(g) for g in value):
        return tuple(tuple(g) for g in value)
    raise ValueError("answers must be a non-empty list of strings, or of non-empty lists of strings")


def parse_line(line: str, separator: str) -> CalibrationPrompt:
    """One line of a prompt file; ValueError naming the field that is wrong."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError("expected a JSON object")
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown fields {unknown}; known: {sorted(_FIELDS)}")
    docs, question, system = raw.get("documents"), raw.get("question"), raw.get("system", SYSTEM)
    if not _strings(docs):
        raise ValueError("documents must be a non-empty list of non-empty strings")
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question must be a non-empty string")
    if not isinstance(system, str):
        raise ValueError("system must be a string")
    texts = {"documents": "".join(docs), "question": question, "system": system}
    for name, text in texts.items():
        if separator in text:
            raise ValueError(f"{name} contains the chunk separator {separator!r}")
    answers = _answers(raw["answers"]) if raw.get("answers") is not None else None
    return CalibrationPrompt(tuple(docs), question, answers, system)


def read_file(path: Path, separator: str) -> tuple[list[CalibrationPrompt], list[str]]:
    """The file's valid prompts, and one message per invalid line (`FILE:LINE: what`)."""
    prompts, errors = [], []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(parse_line(line, separator))
            except ValueError as e:
                errors.append(f"{path}:{number}: {e}")
    return prompts, errors


SPLITS = ("all", "tune", "heldout")
# `--set`: the fidelity questions ("original", "counterfactual", "both"), the real shape's ("rag"),
# or all of them ("all", the default), the sets alternating.
SETS = ("original", "counterfactual", "both", "rag", "all")
# The real shape's prompts: 8 documents of ~500 tokens (issue 56's target shape), and the reply
# length of a free-form answer (bench_rag_shape's `--max-tokens-free`).
RAG_DOCUMENTS, RAG_SIZE, RAG_FREE_TOKENS = 8, 500, 80


def builtin(limit: int, which: str = "all", split: str = "all") -> list[CalibrationPrompt]:
    """The built-in prompts of `which` set(s), the sets alternating (so that a limit keeps every
    kind), the first `limit` (0: all); `split` keeps one half ("tune" or "heldout"). Documents come
    from the `mendeleev` package."""
    if which not in SETS:
        raise ValueError(f"set must be one of {SETS}, got {which!r}")
    sets = []
    if which != "rag":
        questions = builtin_questions(0, "both" if which == "all" else which, split)
        elements = fq.load_elements()
        sets.append(
            [
                CalibrationPrompt(
                    tuple(q.documents(elements)), q.question, tuple(tuple(g) for g in q.answers)
                )
                for q in questions
            ]
        )
    if which in ("rag", "all"):
        sets.append(rag_prompts(split))
    order = _alternating(sets)
    return order[:limit] if limit else order


def rag_prompts(split: str = "all") -> list[CalibrationPrompt]:
    """The real shape's frozen questions over `RAG_DOCUMENTS` documents of ~`RAG_SIZE` tokens (the
    asked facts counterfactual, as bench_rag_shape serves them), their kinds alternating."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    records = rs.load_records()
    kinds: dict[str, list[CalibrationPrompt]] = {kind: [] for kind in rs.KINDS}
    for q in rs.load():
        if q.n == RAG_DOCUMENTS and split in ("all", q.split):
            kinds[q.kind].append(
                CalibrationPrompt(
                    tuple(q.documents(records, RAG_SIZE)),
                    q.question,
                    tuple(tuple(g) for g in q.answers),
                    rag=q,
                    reply_tokens=RAG_FREE_TOKENS if q.kind == "free" else 0,
                )
            )
    return _alternating(list(kinds.values()))


def _alternating(lists: list[list[T]]) -> list[T]:
    """The lists' items taken in turn, one of each while it has any."""
    longest = max((len(x) for x in lists), default=0)
    return [x[i] for i in range(longest) for x in lists if i < len(x)]


def builtin_questions(limit: int, which: str = "both", split: str = "all") -> list[fq.Question]:
    """The frozen questions of `which` set(s), original and counterfactual alternating (so that a
    limit keeps both kinds), the first `limit` (0: all). `split` keeps one half of each set
    ("tune" or "heldout", bench_fidelity's `--split`): a profile made on the tune half leaves the
    held-out half for judging what it chose."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    sets = {
        "original": fq.load_original() if which in ("original", "both") else [],
        "counterfactual": fq.load_counterfactual() if which in ("counterfactual", "both") else [],
    }
    order = _alternating([[q for q in qs if split in ("all", q.split)] for qs in sets.values()])
    return order[:limit] if limit else order
