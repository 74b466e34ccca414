"""Whether a request fits: max_model_len, and the paged KV cache alone (request intake's checks).

A request must fit the whole paged KV cache by itself, or preemption could never let it finish;
a fusion request's streams share it (one share per stream, the pair stream holding its extra
document more). Apart from engine/intake.py so that each reads in one sitting.
"""

from __future__ import annotations

import dataclasses

from chunkcache.core.kv_blocks import BlockManager
from chunkcache.errors import InvalidRequestError, PromptTooLongError
from chunkcache.sampling import SamplingParams


class KVFit:
    def __init__(self, blocks: BlockManager, max_model_len: int) -> None:
        self.blocks = blocks
        self.max_model_len = max_model_len

    def check_length(self, params: SamplingParams, prompt_len: int) -> None:
        """The prompt, and its output if max_tokens is given, fit max_model_len."""
        if prompt_len > self.max_model_len:
            raise PromptTooLongError(
                f"prompt is {prompt_len} tokens long, more than max_model_len {self.max_model_len}"
            )
        if params.max_tokens is not None and prompt_len + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {self.max_model_len}",
                "max_tokens",
            )

    def check_blocks(self, own_tokens: int, copies: int, extra: int) -> None:
        """The tokens computed here fit the KV cache (one share per fusion stream)."""
        need = self.blocks.blocks_for(own_tokens + 1)
        if need > self.blocks.num_blocks:
            raise PromptTooLongError(f"prompt needs {need} KV blocks, the cache has {self.blocks.num_blocks}")
        if self.blocks_needed(own_tokens, 1, copies, extra) > self.blocks.num_blocks:
            raise PromptTooLongError(
                f"prompt needs {self.blocks_needed(own_tokens, 1, copies, extra)} KV blocks (a share per "
                f"stream), the cache has {self.blocks.num_blocks}"
            )

    def blocks_needed(self, own_tokens: int, outputs: int, copies: int = 1, extra: int = 0) -> int:
        """KV blocks of a request's `copies` streams (one for a plain request), each holding its
        own tokens and `outputs`; one of them (a fusion pair stream) `extra` more."""
        per_stream = self.blocks.blocks_for(own_tokens + outputs)
        return (copies - 1) * per_stream + self.blocks.blocks_for(own_tokens + extra + outputs)

    def fit_params(
        self, params: SamplingParams, own_tokens: int, prompt_len: int, copies: int = 1, extra: int = 0
    ) -> SamplingParams:
        """A request must fit the whole paged KV cache alone, or preemption could never let it
        finish: an explicit max_tokens beyond that is refused; an open one (None) is capped there,
        as it is capped at max_model_len otherwise. A fusion request's `copies` streams share it
        (its pair stream holding `extra` tokens more)."""
        capacity = self.blocks.num_blocks // copies * self.blocks.block_size
        room = self.room(own_tokens, copies, extra)
        if params.max_tokens is not None:
            if params.max_tokens > room:
                raise InvalidRequestError(
                    f"max_tokens ({params.max_tokens}) plus the {own_tokens} prompt tokens computed here "
                    f"exceed the KV cache of {capacity} tokens: max_tokens may be at most {room} "
                    "for this prompt",
                    "max_tokens",
                )
            return params
        if room < self.max_model_len - prompt_len:
            return dataclasses.replace(params, max_tokens=room)
        return params

    def room(self, own_tokens: int, copies: int, extra: int, reserve: int = 0) -> int:
        """The most output tokens `copies` streams of `own_tokens` (one `extra` more) fit the
        whole KV cache with (but `reserve` blocks); -1 where not even the prompt does."""
        lo, hi = -1, self.blocks.num_blocks * self.blocks.block_size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            fits = self.blocks_needed(own_tokens, mid, copies, extra) + reserve <= self.blocks.num_blocks
            lo, hi = (mid, hi) if fits else (lo, mid - 1)
        return lo
