"""The synthetic document-QA task the demo model is trained on, and its exact prompt format.

Facts about invented entities (cities, people, companies, rivers, books, ships) are drawn fresh
for every example, so the only way to answer is to read the documents: nothing can be memorised.
(The names come from fixed lists of a few hundred, which the tokenizer learns as single tokens;
who is who, and every number, changes from example to example.) An example is

* a system prompt,
* 2-6 short documents, one entity each and each of another kind: "About {name}." and one
  sentence per fact, in random order, e.g. "About Zorvak. Zorvak has 4120 people. Zorvak lies
  within Pelmara. The mayor of Zorvak is Quilla Brent.",
* a question, answered by restating the fact sentence it rests on, word for word: "How many
  people live in Zorvak?" -> "Zorvak has 4120 people." (single-hop). A share of the questions
  takes two documents, answered with both sentences, bridge first: "How many people live in the
  city where Quilla Brent lives?" -> "Quilla Brent lives in Zorvak. Zorvak has 4120 people."
  (two-hop). Restating makes the value the continuation of words that stand in a document, which
  a small model learns to copy far sooner than it learns to pick a bare value out (measured: the
  same recipe answering with the value alone stayed at ~25% exact match; issue 7's notes).

Why one document per kind: a model small enough to train here in an hour finds a value by the
words before it ("has" -> the population), not by whose sentence it is. Measured on a checkpoint
trained with documents of any kinds: 82% exact match on two documents of different kinds, 52%
(chance) on two of one kind. The shipped checkpoints, which copy by those words reliably (see
chunkcache/demo/induction.py), answer 100% of 60 two-document questions of different kinds and
50% (block) / 47% (full) of 60 of one kind: still chance. The task therefore never puts two
documents of one kind in a prompt, and neither should a user of the demo model (issue 7's notes).

The prompt is a chunked prompt in the chat format of the demo tokenizer's template (ChatML):

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n # # {doc 1} # # ... # # {doc n} # # {question}<|im_end|>\\n<|im_start|>assistant\\n

i.e. `chat_messages(system, docs, question)` rendered by the chat template; `format_prompt` returns
exactly that text *without* the leading BOS, for `LLM.generate(prompt)` (whose default
`add_special_tokens=True` prepends BOS to the system part), while `LLM.chat(chat_messages(...))`
renders the BOS itself: both give the same tokens. Split at the separator " # # ", the parts are
S = the system turn plus "<|im_start|>user\\n", the chunks = the documents verbatim, Q = the question
and the assistant header. The model answers ` {answer}<|im_end|>`: with a leading space, so that
the answer's tokens are exactly those of the words inside the documents; `exact_match` strips it.

A plain-text variant (`chat=False`: "{system} # # {doc 1} # # ... # # {question}\\n", the model
answering ` {answer}<|eos|>`) is trained on a smaller share, so the seed documents' plain form works too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "KINDS",
    "QA",
    "SEPARATOR",
    "SYSTEM_PROMPTS",
    "Example",
    "chat_messages",
    "exact_match",
    "format_prompt",
    "held_out_set",
    "make_example",
    "make_world",
]

SEPARATOR = " # # "
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant. Answer the question with a short phrase from the documents."
)
SYSTEM_PROMPTS: tuple[str, ...] = (
    DEFAULT_SYSTEM_PROMPT,
    "You are a helpful assistant.",
    "Answer the question using the documents below.",
    "Read the documents and answer briefly.",
    "You answer questions about documents. Reply with the exact answer only.",
    "Use only the facts in the documents to answer.",
)

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# ---- invented names ---------------------------------------------------------------------------

# Names come from fixed lists (made once, deterministically, from syllables): the tokenizer learns
# most of them as single tokens, so a small model finds an entity by one token. The facts are drawn
# fresh for every example, so answering still takes reading the documents.
_ONSETS = ("b", "br", "d", "dr", "f", "g", "h", "k", "l", "m", "n", "p", "qu", "r", "s", "t", "v", "z")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "o", "a")
_CODAS = ("", "", "n", "r", "l", "s", "k", "m", "x")


def _name_list(
    seed: int, count: int, syllables: tuple[int, ...], endings: tuple[str, ...] = ("",)
) -> tuple[str, ...]:
    rng = random.Random(seed)
    names: list[str] = []
    while len(names) < count:
        word = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
            for _ in range(rng.choice(syllables))
        )
        word = (word + rng.choice(endings)).capitalize()
        if 4 <= len(word) <= 10 and word not in names:
            names.append(word)
    return tuple(names)


FIRST_NAMES = _name_list(1, 100, (2,))
LAST_NAMES = tuple(n for n in _name_list(2, 130, (2, 3)) if n not in FIRST_NAMES)[:100]
CITY_NAMES = tuple(
    n
    for n in _name_list(3, 260, (1, 2), ("", "", "ia", "ton", "burg", "ford", "vik", "dale", "port"))
    if n not in FIRST_NAMES and n not in LAST_NAMES
)[:200]
COMPANY_STEMS = tuple(n for n in _name_list(4, 200, (2,)) if n not in FIRST_NAMES + LAST_NAMES + CITY_NAMES)[
    :100
]
# Value pools are large on purpose: with a couple of dozen jobs a small model settles on guessing
# a prior over them ("tailor" for every job question) instead of reading the document.
COUNTRIES = tuple(
    n
    for n in _name_list(5, 260, (2, 3), ("ia", "a", "land", "ora", "mark", "avia"))
    if n not in FIRST_NAMES + LAST_NAMES + CITY_NAMES + COMPANY_STEMS
)[:120]
_TAKEN = FIRST_NAMES + LAST_NAMES + CITY_NAMES + COMPANY_STEMS + COUNTRIES
RIVER_NAMES = tuple(n for n in _name_list(6, 200, (2,), ("", "a", "e")) if n not in _TAKEN)[:100]
BOOK_TITLES = tuple(n for n in _name_list(7, 250, (2, 3)) if n not in _TAKEN + RIVER_NAMES)[:100]
SHIP_NAMES = tuple(
    n for n in _name_list(8, 300, (2,), ("", "o", "y")) if n not in _TAKEN + RIVER_NAMES + BOOK_TITLES
)[:100]
_JOBS = (
    "baker", "teacher", "painter", "farmer", "doctor", "sailor", "poet", "carpenter", "judge",
    "singer", "merchant", "pilot", "chemist", "weaver", "tailor", "miner", "lawyer", "gardener",
    "librarian", "fisher", "nurse", "engineer", "potter", "builder", "dentist", "architect",
    "butcher", "chef", "clerk", "dancer", "designer", "driver", "editor", "electrician", "florist",
    "guard", "hunter", "jeweler", "journalist", "mechanic", "musician", "pharmacist",
    "photographer", "plumber", "priest", "professor", "sculptor", "shepherd", "soldier", "surgeon",
    "translator", "waiter", "writer", "actor", "banker", "barber", "blacksmith", "brewer",
    "cashier", "courier", "economist", "geologist", "historian", "locksmith", "mason", "physicist",
    "programmer", "ranger", "roofer", "scientist", "secretary", "tutor", "welder", "beekeeper",
    "astronomer", "biologist", "composer", "glassblower", "ferryman", "accountant",
)  # fmt: skip
_PRODUCTS = (
    "glass jars", "bicycles", "paper", "copper pipes", "wool coats", "clocks", "lanterns", "boats",
    "candles", "shoes", "maps", "ink", "bricks", "radios", "soap", "tea", "rope", "bells", "saddles",
    "telescopes", "cheese", "carpets", "umbrellas", "violins", "pianos", "kites", "hats", "gloves",
    "chairs", "tables", "mirrors", "buttons", "needles", "barrels", "baskets", "blankets", "bottles",
    "brushes", "cameras", "cups", "drums", "engines", "fences", "flutes", "helmets", "jackets",
    "keys", "knives", "ladders", "locks", "nails", "pencils", "plates", "pumps", "rugs", "scissors",
    "skates", "spoons", "tents", "tiles", "toys", "trumpets", "wagons", "wheels", "windows",
    "honey", "bread", "sugar", "salt", "coffee", "perfume", "sails", "tools", "watches", "vases",
)  # fmt: skip


# The kinds of entity a document can describe; the documents of one example are all of different
# kinds (see make_world).
KINDS: tuple[str, ...] = ("city", "person", "company", "river", "book", "ship")
_ENTITY_NAMES = {
    "city": CITY_NAMES,
    "company": COMPANY_STEMS,
    "river": RIVER_NAMES,
    "book": BOOK_TITLES,
    "ship": SHIP_NAMES,
}


# ---- the world and its documents --------------------------------------------------------------


@dataclass
class Entity:
    kind: str  # one of KINDS
    name: str
    facts: dict[str, str]
    doc: str = ""
    sentences: dict[str, str] = field(default_factory=dict)  # fact -> its sentence in the document


@dataclass
class QA:
    question: str
    answer: str
    hops: int  # 1 or 2
    kind: str  # the question template's name, e.g. "city.population" or "person>city.mayor"
    value: str = ""  # the asked value alone ("4120"), inside the answer's last sentence


@dataclass
class Example:
    system: str
    docs: list[str]
    question: str
    answer: str
    hops: int
    kind: str
    value: str
    # Every question the documents answer (the chosen one included); training packs several.
    all_qa: list[QA] = field(default_factory=list, repr=False)

    def prompt(self, chat: bool = True) -> str:
        return format_prompt(self.system, self.docs, self.question, chat=chat)


# A document is a short fact sheet: "About {name}." and one sentence per fact, in random order,
# each naming its entity ("Zorvak has 4120 people."). The question uses the sentence's own words
# ("How many people live in Zorvak?") and the answer is that sentence.
# Names never share a word within an example, so one name token points at one entity. The word
# right before a value differs from fact to fact (" within", " has", " is", " a", " in", " year",
# " at", " makes", " to", " through", " for", " after", " by", " sold", " during", " from",
# " carries", " of"): with one document per kind, restating a sentence leads to its value through
# that word alone. (With " in" before four kinds of values, a model trained for an hour answered
# only the one kind whose cue was unique: jobs after "works as a".)


# kind -> fact -> its sentence ("{x}": the entity's name, "{v}": the value). The order of the facts
# is the order the document's sentences are shuffled from (it changes the documents a seed draws).
_SENTENCES: dict[str, dict[str, str]] = {
    "city": {"country": "{x} lies within {v}.", "population": "{x} has {v} people.", "mayor": "The mayor of {x} is {v}."},
    "person": {"job": "{x} works as a {v}.", "city": "{x} lives in {v}.", "born": "{x} was born in the year {v}."},
    "company": {"city": "{x} is based at {v}.", "product": "{x} makes {v}.", "founded": "{x} dates back to {v}."},
    "river": {"city": "{x} flows through {v}.", "length": "{x} runs for {v} kilometres.", "named": "{x} was named after {v}."},
    "book": {"author": "{x} was written by {v}.", "copies": "{x} sold {v} copies.", "year": "{x} appeared during {v}."},
    "ship": {"city": "{x} set sail from {v}.", "cargo": "{x} carries {v}.", "flag": "{x} flies the flag of {v}."},
}  # fmt: skip


def _fact_sentences(e: Entity) -> dict[str, str]:
    return {fact: text.format(x=e.name, v=e.facts[fact]) for fact, text in _SENTENCES[e.kind].items()}


def _write_doc(rng: random.Random, e: Entity) -> str:
    e.sentences = _fact_sentences(e)
    facts = list(e.sentences.values())
    rng.shuffle(facts)
    return " ".join([f"About {e.name}.", *facts])


# (kind, fact) -> question templates; "{x}" is the entity's name.
_SINGLE: dict[tuple[str, str], tuple[str, ...]] = {
    ("city", "population"): ("How many people live in {x}?",),
    ("city", "mayor"): ("Who is the mayor of {x}?",),
    ("city", "country"): ("In which country is {x}?",),
    ("person", "job"): ("What is the job of {x}?",),
    ("person", "city"): ("Where does {x} live?",),
    ("person", "born"): ("When was {x} born?",),
    ("company", "product"): ("What does {x} make?",),
    ("company", "city"): ("Where is {x} based?",),
    ("company", "founded"): ("When was {x} founded?",),
    ("river", "city"): ("Which city does {x} flow through?",),
    ("river", "length"): ("How long is {x}?",),
    ("river", "named"): ("Who was {x} named after?",),
    ("book", "author"): ("Who wrote {x}?",),
    ("book", "copies"): ("How many copies did {x} sell?",),
    ("book", "year"): ("When did {x} appear?",),
    ("ship", "city"): ("Where did {x} set sail from?",),
    ("ship", "cargo"): ("What does {x} carry?",),
    ("ship", "flag"): ("Which flag does {x} fly?",),
}
# Two-hop: (kind, bridge fact, kind of the bridge entity, fact) -> templates. The answer restates
# the bridge sentence first: the second lookup then reads its entity from the answer so far.
_DOUBLE: dict[tuple[str, str, str, str], tuple[str, ...]] = {
    ("person", "city", "city", "population"): ("How many people live in the city where {x} lives?",),
    ("person", "city", "city", "mayor"): ("Who is the mayor of the city where {x} lives?",),
    ("person", "city", "city", "country"): ("In which country is the city where {x} lives?",),
    ("company", "city", "city", "population"): ("How many people live in the city where {x} is based?",),
    ("company", "city", "city", "mayor"): ("Who is the mayor of the city where {x} is based?",),
    ("company", "city", "city", "country"): ("In which country is the city where {x} is based?",),
    ("city", "mayor", "person", "job"): ("What is the job of the mayor of {x}?",),
    ("city", "mayor", "person", "born"): ("When was the mayor of {x} born?",),
    ("river", "city", "city", "population"): ("How many people live in the city that {x} flows through?",),
    ("ship", "city", "city", "country"): ("In which country is the city that {x} set sail from?",),
    ("book", "author", "person", "job"): ("What is the job of the person who wrote {x}?",),
}


def _own_facts(rng: random.Random, kind: str) -> dict[str, str]:
    """A new entity's facts; those left "" name a city or a person, filled by make_world, since
    they may be another document's entity (a bridge)."""
    if kind == "city":
        return {"country": rng.choice(COUNTRIES), "mayor": "", "population": str(rng.randint(1000, 9999))}
    if kind == "person":
        return {"job": rng.choice(_JOBS), "city": "", "born": str(rng.randint(1900, 2010))}
    if kind == "company":
        return {"product": rng.choice(_PRODUCTS), "city": "", "founded": str(rng.randint(1800, 2020))}
    if kind == "river":
        return {"city": "", "length": str(rng.randint(20, 990)), "named": ""}
    if kind == "book":
        return {"author": "", "copies": str(rng.randint(1000, 9999)), "year": str(rng.randint(1800, 2020))}
    return {"city": "", "cargo": rng.choice(_PRODUCTS), "flag": rng.choice(COUNTRIES)}


def make_world(rng: random.Random, num_docs: int) -> list[Entity]:
    """`num_docs` (at most len(KINDS)) entities of distinct kinds and names, each with a document;
    references between them (a person living in a described city, a described mayor) make two-hop
    questions possible."""
    used: set[str] = set()

    def fresh(names: tuple[str, ...]) -> str:
        while True:
            name = rng.choice(names)
            # No word shared between two names: each name (and each last name) points at one entity.
            if name not in used:
                used.add(name)
                return name

    def person() -> str:
        return f"{fresh(FIRST_NAMES)} {fresh(LAST_NAMES)}"

    entities: list[Entity] = []
    for kind in rng.sample(KINDS, num_docs):
        facts = _own_facts(rng, kind)
        name = person() if kind == "person" else fresh(_ENTITY_NAMES[kind])
        entities.append(Entity(kind, name, facts))
    cities = [e.name for e in entities if e.kind == "city"]
    persons = [e.name for e in entities if e.kind == "person"]
    for e in entities:
        for fact, value in e.facts.items():
            if value:
                continue
            if fact == "city":
                # Often the described city (a possible bridge), else one that is not described.
                e.facts[fact] = cities[0] if cities and rng.random() < 0.6 else fresh(CITY_NAMES)
            else:
                # The mayor, the river's namesake, the author: sometimes the described person.
                e.facts[fact] = persons[0] if persons and rng.random() < 0.4 else person()
    for e in entities:
        e.doc = _write_doc(rng, e)
    return entities


def _questions(rng: random.Random, entities: list[Entity]) -> list[QA]:
    by_name = {e.name: e for e in entities}
    out: list[QA] = []
    for e in entities:
        for (kind, fact), templates in _SINGLE.items():
            if kind == e.kind:
                question = rng.choice(templates).format(x=e.name)
                out.append(QA(question, e.sentences[fact], 1, f"{kind}.{fact}", e.facts[fact]))
        for (kind, bridge_fact, bridge_kind, fact), templates in _DOUBLE.items():
            bridge = by_name.get(e.facts.get(bridge_fact, "")) if kind == e.kind else None
            if bridge is not None and bridge is not e and bridge.kind == bridge_kind:
                answer = f"{e.sentences[bridge_fact]} {bridge.sentences[fact]}"
                name = f"{kind}>{bridge_kind}.{fact}"
                question = rng.choice(templates).format(x=e.name)
                out.append(QA(question, answer, 2, name, bridge.facts[fact]))
    return out


def make_example(
    rng: random.Random,
    min_docs: int = 2,
    max_docs: int = 6,
    two_hop_share: float = 0.3,
    hops: int | None = None,
    system: str | None = None,
) -> Example:
    """One example drawn from `rng`: documents, and a question with its answer.

    `hops` forces single- (1) or two-hop (2) questions; otherwise a two-hop question is chosen with
    probability `two_hop_share` when the documents allow one. `system` fixes the system prompt
    (default: drawn from SYSTEM_PROMPTS, the first one half of the time).
    """
    while True:
        entities = make_world(rng, rng.randint(min_docs, max_docs))
        qas = _questions(rng, entities)
        singles = [q for q in qas if q.hops == 1]
        doubles = [q for q in qas if q.hops == 2]
        want = hops if hops is not None else (2 if doubles and rng.random() < two_hop_share else 1)
        pool = doubles if want == 2 else singles
        if pool:
            break
    qa = rng.choice(pool)
    if system is None:
        system = DEFAULT_SYSTEM_PROMPT if rng.random() < 0.5 else rng.choice(SYSTEM_PROMPTS)
    docs = [e.doc for e in entities]
    return Example(system, docs, qa.question, qa.answer, qa.hops, qa.kind, qa.value, all_qa=qas)


def held_out_set(seed: int, n: int, two_hop_share: float = 0.3) -> list[Example]:
    """A fixed evaluation set: `n` examples from `random.Random(seed)` with the default system
    prompt. The training script draws from other seeds."""
    rng = random.Random(seed)
    return [make_example(rng, two_hop_share=two_hop_share, system=DEFAULT_SYSTEM_PROMPT) for _ in range(n)]


# ---- the prompt format ------------------------------------------------------------------------


def chat_messages(system: str, docs: list[str], question: str) -> list[dict[str, str]]:
    """The chat request whose rendering is `format_prompt(...)` (plus the template's BOS)."""
    user = "".join(SEPARATOR + d for d in docs) + SEPARATOR + question
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def format_prompt(system: str, docs: list[str], question: str, chat: bool = True) -> str:
    """The prompt text, for `LLM.generate` with its default `add_special_tokens=True` (BOS added).

    chat=True (what the model is mostly trained on): the ChatML rendering of `chat_messages`,
    ending with the assistant header; the model answers ` {answer}<|im_end|>`.
    chat=False: `"{system} # # {doc} # # ... # # {question}\\n"`; the model answers ` {answer}<|eos|>`.
    """
    if chat:
        user = "".join(SEPARATOR + d for d in docs) + SEPARATOR + question
        return f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"
    return SEPARATOR.join([system, *docs, question]) + "\n"


def exact_match(output: str, answer: str) -> bool:
    """The benchmark's metric: the generated text, stripped of surrounding whitespace, equals the answer."""
    return output.strip() == answer
