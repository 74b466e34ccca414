"""The joint stream's excerpts (`fusion_joint_excerpt`): the spans of a document that share the
question's words, instead of the whole document.

Why: the exact joint stream S + Ci + Cj + ... + Q prefills every document after the first, so a
question over three ~1,000-token documents pays ~2,000 tokens of prefill before its first token,
most of the request's time (benchmarks/RESULTS.md "bench_rag_shape"). The joint stream is there
to put the facts of several documents side by side, and a question that compares documents names
what it compares ("the higher density", "when ... were discovered"). So the joint stream reads,
of each document after its first, the document's first span (it names what the document is about)
and the spans (lines; sentences within a line) that share the question's words, best first, within
a budget, in the document's order: BM25's term weights within the document (a word in few of its
spans weighs most), words compared by their Snowball stems, common English words left out. A
document that shares no word with the question but in its first span is read whole (nothing
says where its facts are), and the first span's words (the document's subject, named all through
it) locate nothing: a question naming the element but not the property in the document's words
("Which is denser, A or B?") reads A whole, not the spans that name A. The streams of every
document still read them whole; what an excerpt leaves out only the joint stream misses.

Measured before choosing this: the attention the question rows of a document's own stream gave
its tokens (summed over heads, the last row, per layer) ranked the asked field's line among the
top 4 of ~20 in at most 14 of 28 documents at any layer of the 1.5B; 48 tokens of shared words
hold the asked value in 95-97% (benchmarks/RESULTS.md "bench_rag_shape", `excerpt_recall`).
Words cannot find a fact the question paraphrases ("heavier" for "atomic weight"): on
bench_rag_shape's questions in other words the excerpts kept 5 of full prefill's 10 answers, the
whole documents 8, so the option is off by default (benchmarks/RESULTS.md "bench_rag_shape").
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import snowballstemmer
import torch

# A span longer than this is cut: one long paragraph should not be all or nothing.
MAX_SPAN = 48
# A document shorter than this many budgets is read whole: an excerpt would save little of the
# joint stream's time and risk the facts (bench_fidelity's ~100-300-token documents: excerpts of
# them lost 3 of the exact joint stream's answers, benchmarks/RESULTS.md "bench_fidelity").
WHOLE_UNDER = 4
# A closing mark after an initial or a title ("Martin H. Klaproth", "Dr. Smith") ends no sentence.
_NOT_AN_END = re.compile(
    r"(?:^|[^\w.])(?:(?:[A-Z]\.)+|(?:Mr|Mrs|Ms|Dr|Prof|St|Jr|Sr|vs|e\.g|i\.e)\.)[\"')]*$"
)
_WORD = re.compile(r"[^\W_]+")
# Words that say nothing about where a fact is (question words, articles, auxiliaries).
_COMMON = frozenset(
    (  # noqa: SIM905
        "a an and are as at be been by can could did do does for from had has have how in into is "
        "it its of on or than that the their these this those to was were what when where which "
        "who whom whose why will with would"
    ).split()
)


class _Tokenizer(Protocol):
    def __len__(self) -> int: ...
    def batch_decode(self, sequences: list[list[int]]) -> list[str]: ...


@lru_cache(maxsize=1)
def _stemmer() -> snowballstemmer.stemmer:
    return snowballstemmer.stemmer("english")


def stems(text: str) -> list[str]:
    """The stems of `text`'s words, lower-cased, common words left out."""
    words = [w for w in _WORD.findall(text.lower()) if w not in _COMMON]
    return _stemmer().stemWords(words)


@dataclass(frozen=True)
class SpanTable:
    """Per vocabulary id its text, and what that says about span ends: it holds a line break; it
    ends with a sentence's closing mark; it starts with white space (a closing mark ends a sentence
    only before one: "101.325" is one number)."""

    texts: tuple[str, ...]
    newline: torch.Tensor  # [vocab] bool
    closes: torch.Tensor
    spaced: torch.Tensor

    @classmethod
    def of(cls, tokenizer: _Tokenizer, vocab_size: int) -> SpanTable:
        known = min(vocab_size, len(tokenizer))  # the model's table may be padded past the tokenizer's
        texts = tokenizer.batch_decode([[i] for i in range(known)]) + [""] * (vocab_size - known)
        return cls(
            tuple(texts),
            torch.tensor(["\n" in t for t in texts]),
            torch.tensor([t.rstrip(" \"')").endswith((".", "!", "?")) for t in texts]),
            torch.tensor([t[:1].isspace() for t in texts]),
        )

    def text(self, tokens: Sequence[int]) -> str:
        return "".join(self.texts[t] for t in tokens)

    def spans(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """[start, end) spans covering `tokens`: each ends after a line break, or after a closing
        mark followed by white space (not after an initial), or at MAX_SPAN tokens."""
        ids = torch.tensor(tokens, dtype=torch.long)
        ends = self.newline[ids].clone()
        # A closing mark before a line break: the break ends the span (and stays in it).
        closing = self.closes[ids[:-1]] & self.spaced[ids[1:]] & ~self.newline[ids[1:]]
        for i in closing.nonzero().flatten().tolist():
            closing[i] = not _NOT_AN_END.search(self.text(tokens[max(0, i - 5) : i + 1]))
        ends[:-1] |= closing
        out, start = [], 0
        for i in (ends.nonzero().flatten() + 1).tolist() + [len(tokens)]:
            while i - start > MAX_SPAN:
                out.append((start, start + MAX_SPAN))
                start += MAX_SPAN
            if i > start:
                out.append((start, i))
                start = i
        return out


def same_word(a: str, b: str) -> bool:
    """Whether two stems name one word: equal, or one starts the other and both have 4 letters or
    more (Snowball stems "discovered" "discov" but "discovery" "discoveri")."""
    return a == b or (min(len(a), len(b)) >= 4 and (a.startswith(b) or b.startswith(a)))


def scores(span_stems: list[set[str]], question: set[str]) -> list[float]:
    """Each span's sum of BM25 weights (within the document: its spans are the collection) of the
    question's stems it holds."""
    n = len(span_stems)
    holds = [{w for w in question if any(same_word(w, v) for v in s)} for s in span_stems]
    weight = {
        w: math.log(1 + (n - df + 0.5) / (df + 0.5)) for w in question if (df := sum(w in h for h in holds))
    }
    return [sum(weight[w] for w in h) for h in holds]


def excerpt(tokens: Sequence[int], question: Sequence[int], table: SpanTable, budget: int) -> list[int]:
    """At most `budget` of `tokens` (all of them under WHOLE_UNDER budgets, or where no span but
    the first shares a word with the question, the first span's words left out): the first span
    (cut to the budget), then the spans sharing the question's other words, the highest score
    first while they fit, in the document's order."""
    if len(tokens) <= budget or len(tokens) < WHOLE_UNDER * budget:
        return list(tokens)
    spans = table.spans(tokens)
    span_stems = [set(stems(table.text(tokens[a:b]))) for a, b in spans]
    # Words of the first span name what the document is about ("Hydrogen (H, atomic number 1)"): the
    # rest of it mentions them anywhere, so they locate no fact.
    asked = {w for w in stems(table.text(question)) if not any(same_word(w, v) for v in span_stems[0])}
    score = scores(span_stems, asked)
    ranked = sorted((k for k in range(1, len(spans)) if score[k] > 0), key=lambda k: (-score[k], k))
    if not ranked:
        return list(tokens)
    first_start, first_end = spans[0]
    chosen = [(first_start, min(first_end, first_start + budget))]
    left = budget - (chosen[0][1] - chosen[0][0])
    for k in ranked:
        start, end = spans[k]
        if end - start <= left:
            chosen.append((start, end))
            left -= end - start
    return [t for start, end in sorted(chosen) for t in tokens[start:end]]
