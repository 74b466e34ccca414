"""bench_serve's workload: a corpus of real text chunks, RAG requests over them, arrival times.

Pure functions of their arguments and a seed: the same arguments give the same prompts, which is
what lets every side of a comparison serve the same text.

- The corpus: `M` chunks, each one chemical element's document of about `size` tokens from the
  `mendeleev` package's database (`chunkcache.fidelity.rag_shape`, the real-shape RAG set's
  documents: description, uses, sources, then "Label: value unit" lines), elements drawn at random
  from those whose documents reach the largest size.
- A request: `k` chunks (k uniform in [k_min, k_max]) drawn without replacement by Zipf popularity
  (chunk of rank r weighs 1/r^s, the ranks a fixed random permutation of the corpus), put in random
  order, then a question about one of them ("What is the density of Iron?", a property its text
  states). Its prompt is chunkcache's separator format, `SYSTEM # # doc1 # # ... # # question`;
  its output length is uniform in [out_min, out_max], fixed (forced with ignore_eos).
- Warm-up prompts: every chunk once, `per_prompt` at a time in corpus order.
- Arrivals: Poisson at `rate` requests/s (exponential gaps), or all at once for rate inf.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass
from typing import Any

SEPARATOR = " # # "
SYSTEM = "You are a helpful assistant. Answer the question from the documents."


@dataclass(frozen=True)
class Chunk:
    name: str  # what the chunk is about (the element)
    text: str
    questions: tuple[str, ...]  # questions its text answers


@dataclass(frozen=True)
class Request:
    index: int
    chunks: tuple[int, ...]  # corpus indices, in prompt order
    question: str
    prompt: str
    max_tokens: int


def prompt_text(texts: list[str], question: str) -> str:
    return SEPARATOR.join([SYSTEM, *texts, question])


def element_chunk(record: Any, size: int) -> Chunk:
    """One element's document of ~`size` tokens, with the questions about the asked properties
    (`rag_shape.ASKED`) whose values its text shows."""
    from chunkcache.fidelity.rag_shape import ASKED

    text = record.document(size).strip()
    if SEPARATOR.strip() in text:
        raise ValueError(f"{record.name}'s document holds the separator")
    questions = tuple(
        f"What is the {ASKED[field][1]} of {record.name}?"
        for field, value in record.values.items()
        if f": {value}" in text
    )
    return Chunk(record.name, text, questions or (f"What does the document say about {record.name}?",))


def element_corpus(m: int, size: int, seed: int) -> list[Chunk]:
    """`m` elements' documents of ~`size` tokens, drawn with `seed` (needs `mendeleev`)."""
    from chunkcache.fidelity.rag_shape import load_records, pool

    records = load_records()
    ids = pool(records)
    if not 0 < m <= len(ids):
        raise ValueError(f"the corpus holds 1 to {len(ids)} chunks (elements), not {m}")
    return [element_chunk(records[n], size) for n in random.Random(seed).sample(ids, m)]


def zipf_weights(m: int, s: float, seed: int) -> list[float]:
    """Weight of each corpus index: 1/rank^s, the ranks a random permutation fixed by `seed`."""
    ranks = list(range(1, m + 1))
    random.Random(seed).shuffle(ranks)
    return [1.0 / r**s for r in ranks]


def draw_without_replacement(rng: random.Random, weights: list[float], k: int) -> list[int]:
    """`k` distinct indices, each draw by the weights of those left (numpy's choice without
    replacement), returned in random order (the draws come out popular first)."""
    if not 0 <= k <= len(weights):
        raise ValueError(f"cannot draw {k} of {len(weights)}")
    left = list(range(len(weights)))
    chosen = []
    for _ in range(k):
        i = rng.choices(range(len(left)), weights=[weights[j] for j in left])[0]
        chosen.append(left.pop(i))
    rng.shuffle(chosen)
    return chosen


def build_requests(
    corpus: list[Chunk],
    n: int,
    k_range: tuple[int, int],
    out_range: tuple[int, int],
    zipf: float,
    seed: int,
) -> list[Request]:
    """`n` requests over the corpus (module docstring)."""
    (k_min, k_max), (out_min, out_max) = k_range, out_range
    if not 1 <= k_min <= k_max <= len(corpus):
        raise ValueError(f"need 1 <= k_min <= k_max <= {len(corpus)} (the corpus), got {k_min}..{k_max}")
    if not 1 <= out_min <= out_max:
        raise ValueError(f"need 1 <= out_min <= out_max, got {out_min}..{out_max}")
    weights = zipf_weights(len(corpus), zipf, seed)
    rng = random.Random(seed + 1)
    requests = []
    for i in range(n):
        chosen = draw_without_replacement(rng, weights, rng.randint(k_min, k_max))
        question = rng.choice(corpus[rng.choice(chosen)].questions)
        prompt = prompt_text([corpus[c].text for c in chosen], question)
        requests.append(Request(i, tuple(chosen), question, prompt, rng.randint(out_min, out_max)))
    return requests


def warmup_prompts(corpus: list[Chunk], per_prompt: int = 4) -> list[str]:
    """Every chunk once, `per_prompt` at a time in corpus order."""
    return [
        prompt_text(
            [c.text for c in corpus[i : i + per_prompt]], "Which elements do these documents describe?"
        )
        for i in range(0, len(corpus), per_prompt)
    ]


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each of `n` requests is sent: a Poisson process of `rate`
    requests/s (the first at 0), or all at 0 for an infinite rate."""
    if rate <= 0:
        raise ValueError(f"a rate is > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


def parse_list(text: str | None, kind: type = float) -> list[Any]:
    """ "0.05,0.1,inf" -> [0.05, 0.1, inf]; None or "" -> []."""
    return [kind(x) for x in (text or "").split(",") if x.strip()]


def slices(n: int, rounds: int) -> list[range]:
    """`n` indices cut into up to `rounds` consecutive slices of near-equal size."""
    rounds = max(1, min(rounds, n))
    bounds = [n * r // rounds for r in range(rounds + 1)]
    return [range(a, b) for a, b in itertools.pairwise(bounds) if b > a]
