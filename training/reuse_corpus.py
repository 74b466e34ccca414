"""Training prompts for the reuse adapter: real text, several documents, one question.

The documents are CPython's own reference documentation as every Python install ships it
(`pydoc_data.topics`: the language reference's sections, written by the Python developers), cut
into passages of a few sentences under a title line. None of it is the fidelity benchmark's text
(element encyclopedia entries from `mendeleev`), so training on it cannot leak held-out answers.

A prompt is rendered exactly as the benchmark and the engine see one: chat template, system turn,
user turn `SEP doc1 SEP ... SEP docN SEP question`, split by `parse_chunked_prompt`. The question
is drawn from templates that make the model find one or two documents by their title, position or
content and copy from them, the skill that independently encoded documents lose. Nobody grades
the answers: the teacher is the same model reading the prompt with a full prefill.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chunkcache.chunk.parse import parse_chunked_prompt

SEP = " # # "
SYSTEM = "Answer the question using the documents. Reply with a short answer."
ORDINALS = ("first", "second", "third", "fourth", "fifth")


@dataclass(frozen=True)
class Passage:
    title: str
    text: str  # a few whole paragraphs of one section

    def document(self) -> str:
        return f"{self.title}\n{self.text}\n"


@dataclass(frozen=True)
class Sample:
    """One training prompt: its text as rendered, and its tokens as the engine splits them."""

    text: str
    sys_ids: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    q_ids: tuple[int, ...]
    question: str

    @property
    def prompt_ids(self) -> list[int]:
        return [*self.sys_ids, *(t for c in self.chunks for t in c), *self.q_ids]


_UNDERLINE = re.compile(r"^[*=\-~^]{3,}\s*$")


def passages(min_chars: int = 350, max_chars: int = 750) -> list[Passage]:
    """Every section of the language reference cut into passages of whole paragraphs."""
    from pydoc_data.topics import topics

    out: list[Passage] = []
    for key in sorted(topics):
        lines = [ln.rstrip() for ln in topics[key].splitlines()]
        lines = [ln for ln in lines if not _UNDERLINE.match(ln)]
        while lines and not lines[0].strip():
            lines.pop(0)
        if not lines:
            continue
        title = lines[0].strip()
        paragraphs = [p.strip() for p in "\n".join(lines[1:]).split("\n\n") if p.strip()]
        part, buf = 1, ""
        for para in paragraphs:
            if len(para) > max_chars:  # long grammar blocks and tables: keep their head only
                para = para[:max_chars].rsplit(" ", 1)[0]
            if buf and len(buf) + len(para) > max_chars:
                out.append(Passage(f"{title} (part {part})", buf))
                part, buf = part + 1, ""
            buf = f"{buf}\n{para}" if buf else para
            if len(buf) >= min_chars:
                out.append(Passage(f"{title} (part {part})", buf))
                part, buf = part + 1, ""
        if len(buf) >= min_chars // 2:
            out.append(Passage(f"{title} (part {part})", buf))
    return out


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z][A-Za-z_]{3,}", text)


def _phrase(rng: random.Random, text: str, n: int = 4) -> str | None:
    """n consecutive words of `text` that some word follows (the question asks for it)."""
    words = text.split()
    if len(words) < n + 2:
        return None
    i = rng.randrange(0, len(words) - n - 1)
    return " ".join(words[i : i + n])


def _question(rng: random.Random, docs: list[Passage]) -> str:
    target = rng.randrange(len(docs))
    doc = docs[target]
    first = " ".join(doc.text.split(". ")[0].split()[:16])
    phrase = _phrase(rng, doc.text)
    other = docs[(target + 1 + rng.randrange(len(docs) - 1)) % len(docs)]
    term = rng.choice(_words(doc.text) or [doc.title])
    makers: list[Callable[[], str]] = [
        lambda: f"What is the first sentence of the document titled {doc.title!r}?",
        lambda: f"What is the title of the {ORDINALS[target]} document?",
        lambda: f"Which document mentions {first!r}? Give its title.",
        lambda: f"What does the document titled {doc.title!r} say about {term}?",
        lambda: f"Summarize the document titled {doc.title!r} in one sentence.",
        lambda: f"Where are the documents titled {doc.title!r} and {other.title!r}: first, second, ...?",
        lambda: f"What do the documents titled {doc.title!r} and {other.title!r} have in common?",
    ]
    if phrase is not None:
        makers.append(lambda: f"In the document titled {doc.title!r}, which word follows {phrase!r}?")
    return rng.choice(makers)()


def render(tokenizer: Any, docs: list[Passage], question: str) -> str:
    user = "".join(SEP + d.document() for d in docs) + SEP + question
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def samples(tokenizer: Any, count: int, seed: int, docs_per_prompt: tuple[int, int] = (3, 5)) -> list[Sample]:
    """`count` prompts of 3-5 passages from different sections, in random order."""
    rng = random.Random(seed)
    pool = passages()
    out: list[Sample] = []
    while len(out) < count:
        picked = rng.sample(pool, rng.randint(*docs_per_prompt))
        if len({p.title.rsplit(" (part", 1)[0] for p in picked}) < len(picked):
            continue  # two parts of one section would make titles near-ambiguous
        question = _question(rng, picked)
        text = render(tokenizer, picked, question)
        parsed = parse_chunked_prompt(text, SEP, tokenizer, False)
        assert parsed is not None
        out.append(Sample(text, parsed.sys_token_ids, parsed.chunks, parsed.question_token_ids, question))
    return out
