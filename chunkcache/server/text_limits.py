"""Refusing text that cannot fit before it is tokenized.

Tokenizing is the costly part of refusing a long prompt: a 3.9 MB prompt took 4-5 s of the one
preparation thread and kept 300-800 MB of resident memory (malloc keeps what a step frees,
chunkcache/malloc.py) only to be told it exceeds max_model_len. A token stands for at most as many
characters as the longest vocabulary entry (byte-level vocabularies spell each byte as one
character, so an entry's length bounds its decoded text too), times a margin for normalizers that
compose several characters into one (NFC: at most 4 to 1). Text longer than that bound times the
tokens allowed cannot fit, whatever the tokenizer does with it, and is refused at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from chunkcache.chunk.documents import PromptParts
from chunkcache.errors import PromptTooLongError

# Tokens one prewarm call may compute (system part and documents together): a prewarm holds the
# engine for its whole prefill, so an unbounded one stalls every other request (60 documents of
# 7,000 tokens took 83 s); larger sets are sent in several calls.
DEFAULT_MAX_PREWARM_TOKENS = 65_536

# Characters a normalizer may compose into one (NFC composes at most 4 code points into 1).
_NORMALIZER_MARGIN = 4


def max_token_chars(tokenizer: Any) -> int:
    """The most characters of text one token of `tokenizer` can stand for (with the margin)."""
    vocab = tokenizer.get_vocab()
    return _NORMALIZER_MARGIN * max(map(len, vocab), default=1)


class TextBound:
    """The longest text, in characters, that can become `max_tokens` tokens per part.

    Chunked prompts and documents are tokenized part by part, and each part is limited on its own
    (a system part plus one chunk fits max_model_len), so the bound grows with the parts."""

    def __init__(self, tokenizer: Any, max_model_len: int, separator: str | None, max_chunks: int) -> None:
        self.chars_per_token = max_token_chars(tokenizer)
        self.max_model_len = max_model_len
        self.separator = separator
        self.max_parts = max_chunks + 2  # system, chunks, question

    def check_prompt(self, prompt: str | list[int] | PromptParts, param: str) -> None:
        """PromptTooLongError (HTTP 400) if `prompt` cannot fit max_model_len tokens."""
        if isinstance(prompt, PromptParts):
            parts = [prompt.system, *prompt.chunks, prompt.question]
        elif isinstance(prompt, str):
            parts = prompt.split(self.separator) if self.separator else [prompt]
        else:
            return  # token ids are counted exactly by the engine
        self._check(parts, self.max_model_len, param, "max_model_len")

    def check_total(self, texts: Sequence[str], max_tokens: int, param: str, what: str) -> None:
        """PromptTooLongError if `texts` together cannot fit `max_tokens` tokens (`what` names the limit)."""
        chars = sum(map(len, texts))
        if chars > max_tokens * self.chars_per_token:
            raise PromptTooLongError(self._message(param, chars, max_tokens, what), param)

    def _check(self, parts: Sequence[str], tokens_per_part: int, param: str, what: str) -> None:
        chars = sum(map(len, parts))
        limit = min(len(parts), self.max_parts) * tokens_per_part * self.chars_per_token
        if chars > limit:
            raise PromptTooLongError(self._message(param, chars, tokens_per_part, what), param)

    def _message(self, param: str, chars: int, tokens: int, what: str) -> str:
        return (
            f"{param} is {chars} characters long: more than {what} {tokens} tokens can hold "
            f"(at most {self.chars_per_token} characters a token for this tokenizer); refused "
            "before tokenizing"
        )
