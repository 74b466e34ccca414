"""Output text and stop conditions of a sequence after each new token."""

from __future__ import annotations

from typing import Any

from chunkcache.core.sequence import Sequence


class Detokenizer:
    def __init__(self, tokenizer: Any, eos_token_ids: frozenset[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def update(self, seq: Sequence) -> None:
        """Refresh `seq.text` for its newest token and set `finish_reason` when a stop condition holds."""
        p = seq.params
        token = seq.token_ids[-1]
        if not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif seq.grammar is not None and seq.grammar.is_stopped():
            seq.finish_reason, seq.stop_reason = "stop", None  # the structured output is complete
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
        # A trailing replacement char is an incomplete multi-byte character: wait for more tokens.
        if text.endswith("\ufffd") and seq.finish_reason is None:
            text = text.rstrip("\ufffd")
        # Before min_tokens, stop strings do not count (vLLM); EOS and stop ids are masked in sampling.
        if p.stop and seq.finish_reason is None and seq.num_output_tokens >= p.min_tokens:
            longest = max(map(len, p.stop))
            search_from = max(0, len(seq.text) - longest + 1)
            hits = [(text.find(s, search_from), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                text = text[:i]
                seq.finish_reason, seq.stop_reason = "stop", s
        seq.text = text
        if seq.finish_reason is None and (
            (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens)
            or seq.last_position() + 1 >= self.max_model_len
        ):
            seq.finish_reason = "length"
