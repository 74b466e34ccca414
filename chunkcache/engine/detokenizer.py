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
        """Refresh `seq.reply.text` for its newest token; set its `finish_reason` when a stop holds."""
        p, r = seq.params, seq.reply
        token = seq.token_ids[-1]
        if not p.ignore_eos and token in self.eos_token_ids:
            r.finish_reason, r.stop_reason = "stop", None
        elif token in p.stop_token_ids:
            r.finish_reason, r.stop_reason = "stop", token
        elif r.grammar is not None and r.grammar.is_stopped():
            r.finish_reason, r.stop_reason = "stop", None  # the structured output is complete
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=p.skip_special_tokens)
        # A trailing replacement char is an incomplete multi-byte character: wait for more tokens.
        if text.endswith("\ufffd") and r.finish_reason is None:
            text = text.rstrip("\ufffd")
        # Before min_tokens, stop strings do not count (vLLM); EOS and stop ids are masked in sampling.
        if p.stop and r.finish_reason is None and seq.num_output_tokens >= p.min_tokens:
            longest = max(map(len, p.stop))
            search_from = max(0, len(r.text) - longest + 1)
            hits = [(text.find(s, search_from), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                i, s = min(hits)
                text = text[:i]
                r.finish_reason, r.stop_reason = "stop", s
        r.text = text
        if r.finish_reason is None and (
            (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens)
            or seq.last_position() + 1 >= self.max_model_len
        ):
            r.finish_reason = "length"
