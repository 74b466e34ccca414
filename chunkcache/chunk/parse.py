"""Splitting a chunked prompt `S SEP C1 SEP ... SEP Cn SEP Q` into separately tokenized parts."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from chunkcache.core.plan import ChunkedPrompt
from chunkcache.errors import InvalidRequestError

logger = logging.getLogger(__name__)


def split_text(text: str, separator: str) -> tuple[str, list[str], str] | None:
    """(S, chunks, Q) of a prompt with at least two separators, else None (empty chunks kept:
    `tokenize_parts` drops them, and says so)."""
    parts = text.split(separator)
    if len(parts) < 3:
        return None
    return parts[0], parts[1:-1], parts[-1]


def parse_chunked_prompt(
    text: str, separator: str, tokenizer: Any, add_special_tokens: bool = True
) -> ChunkedPrompt | None:
    """Tokenize each part on its own (S with the tokenizer's special prefix such as BOS, the others
    without), so that a chunk's tokens never depend on its neighbours. None = not a chunked prompt."""
    split = split_text(text, separator)
    if split is None:
        return None
    sys_text, chunk_texts, question = split
    if not any(chunk_texts):
        raise InvalidRequestError("chunked prompt has separators but no non-empty chunk")
    return tokenize_parts(sys_text, chunk_texts, question, tokenizer, add_special_tokens)


def tokenize_parts(
    sys_text: str, chunk_texts: Sequence[str], question: str, tokenizer: Any, add_special_tokens: bool
) -> ChunkedPrompt:
    """The parts of a prompt tokenized each on its own; chunks with no token are dropped."""
    sys_ids = tuple(tokenizer.encode(sys_text, add_special_tokens=add_special_tokens))
    encoded = [tuple(tokenizer.encode(c, add_special_tokens=False)) for c in chunk_texts]
    chunks = tuple(c for c in encoded if c)
    if len(chunks) < len(encoded):
        empty = [i for i, c in enumerate(encoded) if not c]
        logger.info(
            "skipped %d of %d chunks that tokenize to nothing (chunks %s, counted from 0); the "
            "request is served over the others",
            len(empty),
            len(encoded),
            empty,
        )
    q_ids = tuple(tokenizer.encode(question, add_special_tokens=False))
    if not chunks:
        raise InvalidRequestError("chunked prompt has no chunk with any token")
    return ChunkedPrompt(sys_ids, chunks, q_ids)
