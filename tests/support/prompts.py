"""The documents, system part and questions the chunked-prompt tests share (`S # # C1 ... # # Q`).

Tiny random checkpoints answer nonsense, so the texts matter only as token sequences of different
lengths; a test that needs a particular shape (a one-token document, a longer set) composes it from
these names so that the reader sees what differs.
"""

from __future__ import annotations

from chunkcache.sampling import SamplingParams

SEP = " # # "
SYSTEM = "You answer questions about the documents."

ALICE = "Alice lives in Paris and drinks tea every morning."
COINS = "The red box holds 42 coins"
BOB = "Bob was born in 1990 in Rome, the capital of Italy, and he works as a baker."
CAROL = "Carol keeps three cats and a dog named Rex in her small flat by the sea."
ZORVAK = "Zorvak is a city of 4120 people."
RIVER = "The river runs north for 300 miles before it reaches the cold grey ocean in the far north."
DOCS = [ALICE, COINS, BOB, CAROL, ZORVAK]

QUESTION = "Where does Alice live?"
QUESTIONS = [QUESTION, "How many coins are in the box?", "What is the dog called?"]

# The first token's distribution: what the oracle comparisons check.
FIRST = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
# Blend options for a full recompute and for pure reuse (whose output differs from a full
# prefill's, so a skipped blend cannot pass a comparison).
FULL = {"chunk_layout": "offset", "blend_check_layers": [0], "blend_recompute_ratios": [1.0]}
REUSE = {"chunk_layout": "offset", "blend_check_layers": [0], "blend_recompute_ratios": [0.0]}


def chunked(system: str, docs: list[str], question: str) -> str:
    """A chunked prompt: the system part, the documents and the question, joined by SEP."""
    return SEP.join([system, *docs, question])
