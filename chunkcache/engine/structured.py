"""Structured output: JSON that follows a schema (OpenAI's `response_format` json_object /
json_schema), decoded under a grammar by llguidance (a maintained Rust library, CPU only).

Each such request owns a matcher: before sampling, the tokens its grammar forbids get a logit of
-inf; after sampling, the token is consumed. When the grammar is complete the matcher stops and
the request finishes with "stop". An invalid schema is refused when the request is added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from chunkcache.errors import InvalidRequestError

if TYPE_CHECKING:
    from llguidance import LLMatcher


class StructuredOutputs:
    """The engine's grammar compiler: one llguidance tokenizer, built on first use (~1 s)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._tokenizer: Any = None

    def _ll_tokenizer(self) -> Any:
        if self._tokenizer is None:
            import llguidance.hf  # imported where used: only structured requests need it

            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        return self._tokenizer

    def matcher(self, schema: dict[str, Any]) -> LLMatcher:
        """A fresh matcher for a JSON schema; InvalidRequestError when the schema is not usable."""
        import llguidance

        if not isinstance(schema, dict):
            raise InvalidRequestError(
                f"a JSON schema must be an object, got {type(schema).__name__}", "json_schema"
            )
        try:
            # Compact JSON (no free whitespace): a model cannot pad its output with spaces forever.
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            )
        except ValueError as e:
            raise InvalidRequestError(f"invalid JSON schema in response_format: {e}", "json_schema") from None
        tokenizer = self._ll_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise InvalidRequestError(f"invalid JSON schema in response_format: {error}", "json_schema")
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(
                f"invalid JSON schema in response_format: {matcher.get_error()}", "json_schema"
            )
        return matcher


def allowed_tokens(matcher: Any, vocab_size: int) -> torch.Tensor:
    """Bool [vocab]: the tokens the matcher's grammar allows next (bit t of the little-endian
    bitmask is token t)."""
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    allowed = torch.from_numpy(bits[:vocab_size].astype(bool))
    if allowed.numel() < vocab_size:  # a model vocabulary wider than the mask: the rest is forbidden
        allowed = torch.cat((allowed, torch.zeros(vocab_size - allowed.numel(), dtype=torch.bool)))
    return allowed
