"""`tokenizer.encode` for ASCII text of a byte-level BPE tokenizer, one pre-token at a time from a
cache of each pre-token's ids.

Why: the router tokenizes every prompt part it has not seen, and transformers' tokenizer spends
~0.5 us per token (most of it in `tokenizers`' pre-tokenizer bookkeeping, not in BPE), so a cold
8k-token RAG prompt cost ~6 ms before any key was computed.

Why it is exact: a byte-level BPE tokenizer without a normalizer that changes ASCII (none, NFC,
NFKC) cuts the text into pre-tokens with its regex, maps each pre-token's bytes to characters,
and runs BPE on each pre-token alone; the post-processor then adds its special tokens around the
ids. So the ids of a text are the concatenation of its pre-tokens' ids, and a pre-token's ids
depend on its string only. Here the split is the same regex run by Python's `re` (for ASCII text
the Unicode classes are plain ASCII ranges), and a pre-token never seen before is sent through
the tokenizer's own BPE model (`model.tokenize`), after the tokenizer's own byte mapping. Text
that is not ASCII, or that contains an added token's text (special tokens are cut out before the
pre-tokenizer), goes to `tokenizer.encode` itself. `WordEncoder.for_tokenizer` returns None for a
pipeline it does not know, and checks itself against the tokenizer on probe texts before use.
Recurring words (natural text is mostly recurring words, even in documents never seen) are then
a dict lookup: ~0.1 us per token.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from itertools import chain
from typing import Any

# The tokenizers' regexes (as in their tokenizer.json) and the same split for ASCII text in
# Python's `re` with re.ASCII: \p{L} is [A-Za-z], \p{N} is [0-9], and \s is [ \t\n\r\f\v] in
# both (Oniguruma's Unicode \s holds no other ASCII character).
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_ASCII_SPLITS: dict[str, str] = {
    _GPT2: r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+",
    _LLAMA3: (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]{1,3}| ?[^\sA-Za-z0-9]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    _QWEN2: (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\nA-Za-z0-9]?[A-Za-z]+|[0-9]| ?[^\sA-Za-z0-9]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
# Normalizers that leave ASCII text as it is.
_ASCII_IDENTITY_NORMALIZERS = (None, "NFC", "NFKC")

# Texts whose ids the encoder must reproduce before it is used: contractions, digits, runs of
# spaces, tabs and newlines, punctuation runs, control characters.
_PROBES = (
    "Hello world",
    "It's what they'd've SAID: don't, I'M, we'LL 're 've.",
    "  leading and trailing  \n\n\tindented\r\n  x\t\t y   ",
    "numbers 1 12 123 1234 12345 3.14159 -7 1e9 0x1F #42 $5,000.00",
    'punct!!! ?? ... --- (a) [b] {c} <d> "e" `f` ~g ^h |i| \\j/ @k *l* _m_ +n= %o &p;',
    "\x00\x01\x1c\x1f\x7f mixed\x0bvertical\x0cfeed",
    "a",
    " ",
    "\n",
    "",
)


def _split_regex(pre_tokenizer: dict[str, Any] | None) -> str | None:
    """The onig regex of a byte-level pre-tokenizer that splits, then maps bytes; None otherwise."""
    if pre_tokenizer is None:
        return None
    kind = pre_tokenizer.get("type")
    if kind == "ByteLevel":
        if pre_tokenizer.get("add_prefix_space") or not pre_tokenizer.get("use_regex", True):
            return None
        return _GPT2
    if kind != "Sequence":
        return None
    steps = pre_tokenizer.get("pretokenizers") or []
    if len(steps) != 2:
        return None
    split, byte_level = steps
    if (
        split.get("type") != "Split"
        or split.get("behavior") != "Isolated"
        or split.get("invert")
        or byte_level.get("type") != "ByteLevel"
        or byte_level.get("add_prefix_space")
        or byte_level.get("use_regex", True)
    ):
        return None
    regex = (split.get("pattern") or {}).get("Regex")
    return regex if isinstance(regex, str) else None


class WordEncoder:
    """`encode(text, add_special_tokens)` equal to `tokenizer.encode`'s, faster on ASCII text.
    Build it with `for_tokenizer`. Thread-safe. The pre-token cache is cleared when it passes
    `capacity_words` entries (a bound, not an LRU: clearing costs one re-learning per word)."""

    def __init__(
        self,
        tokenizer: Any,
        backend: Any,
        split_pattern: str,
        prefix: Sequence[int],
        suffix: Sequence[int],
        capacity_words: int,
    ) -> None:
        from tokenizers import pre_tokenizers

        self.tokenizer = tokenizer
        self._model = backend.model
        self._split = re.compile(split_pattern, re.ASCII).findall
        self._prefix = list(prefix)
        self._suffix = list(suffix)
        self.capacity_words = capacity_words
        # The tokenizer's own byte -> character mapping, for the 128 ASCII bytes.
        mapper = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        self._byte_chars = {c: mapper.pre_tokenize_str(chr(c))[0][0] for c in range(128)}
        added = backend.get_added_tokens_decoder()
        contents = sorted({t.content for t in added.values() if t.content}, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, contents))).search if contents else None
        self._ids: dict[str, tuple[int, ...]] = {}
        self._lock = threading.Lock()
        self.fallbacks = 0  # texts sent to the tokenizer (not ASCII, or holding an added token)
        # Pre-tokens encoded, and those not in the cache (sent through BPE): statistics, not
        # exact under concurrent calls.
        self.pretokens = 0
        self.learned = 0

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, capacity_words: int = 1 << 18) -> WordEncoder | None:
        """An encoder for a transformers fast tokenizer (or a `tokenizers.Tokenizer`) whose
        pipeline it reproduces exactly; None for any other tokenizer, or when a probe text's ids
        differ from the tokenizer's."""
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "get_added_tokens_decoder"):  # added tokens must be cut out first
            return None
        try:
            config = json.loads(backend.to_str())
        except Exception:  # not a `tokenizers` tokenizer
            return None
        normalizer = config.get("normalizer")
        model = config.get("model") or {}
        if (normalizer or {}).get("type") not in _ASCII_IDENTITY_NORMALIZERS:
            return None
        if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
            return None
        split = _ASCII_SPLITS.get(_split_regex(config.get("pre_tokenizer")) or "")
        if split is None:
            return None
        affixes = _special_affixes(tokenizer)
        if affixes is None:
            return None
        enc = cls(tokenizer, backend, split, *affixes, capacity_words)
        for text in _PROBES:
            for special in (False, True):
                if list(enc.encode(text, special)) != list(
                    tokenizer.encode(text, add_special_tokens=special)
                ):
                    return None
        enc.fallbacks = enc.pretokens = enc.learned = 0
        return enc

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text.isascii() or (self._added is not None and self._added(text)):
            self.fallbacks += 1
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        words = self._split(text)
        self.pretokens += len(words)
        try:
            ids = list(chain.from_iterable(map(self._ids.__getitem__, words)))
        except KeyError:
            ids = list(chain.from_iterable(map(self._learn(words).__getitem__, words)))
        if add_special_tokens and (self._prefix or self._suffix):
            return [*self._prefix, *ids, *self._suffix]
        return ids

    def _learn(self, words: list[str]) -> dict[str, tuple[int, ...]]:
        """The ids of every distinct word of `words`, new ones through the tokenizer's BPE model.
        Answered from this call's own reads: another thread may clear the table meanwhile."""
        table = self._ids
        distinct = set(words)
        known = {w: ids for w in distinct if (ids := table.get(w)) is not None}
        to_chars = self._byte_chars
        learned = {
            w: tuple(t.id for t in self._model.tokenize(w.translate(to_chars)))
            for w in distinct - known.keys()
        }
        self.learned += len(learned)
        with self._lock:
            if len(table) + len(learned) > self.capacity_words:
                table.clear()
            table.update(learned)
        known.update(learned)
        return known

    def __len__(self) -> int:
        return len(self._ids)


def _special_affixes(tokenizer: Any) -> tuple[list[int], list[int]] | None:
    """The ids the tokenizer puts before and after a text with add_special_tokens=True (its BOS,
    an EOS), the same for every probe; None when they cannot be told apart from the text's ids."""
    found: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    for text in ("a", "Hello world", "x y z 1 2 3"):
        bare = list(tokenizer.encode(text, add_special_tokens=False))
        full = list(tokenizer.encode(text, add_special_tokens=True))
        starts = [i for i in range(len(full) - len(bare) + 1) if full[i : i + len(bare)] == bare]
        if len(starts) != 1 or not bare:
            return None
        i = starts[0]
        found.add((tuple(full[:i]), tuple(full[i + len(bare) :])))
    if len(found) != 1:
        return None
    prefix, suffix = found.pop()
    return list(prefix), list(suffix)
