"""Sampling parameters of a request (vLLM-like), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# A temperature below this samples greedily, as in vLLM: dividing logits by ~0 overflows to inf/NaN.
SAMPLING_EPS = 1e-5
# Seeds torch.Generator.manual_seed accepts: a signed or unsigned 64-bit integer.
SEED_RANGE = (-(2**63), 2**64 - 1)
# Stop strings are matched against the text after every token: bound their work per token.
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = off
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to max_model_len
    stop: list[str] | str | None = None  # excluded from the returned text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k log-probabilities of each generated token

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:  # NaN fails the comparison
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise ValueError(f"logprobs must be a non-negative integer, got {self.logprobs!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise ValueError(
                f"seed must be an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (64 bits), got {self.seed!r}"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters, got one of {len(s)}"
                )
        for t in self.stop_token_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"stop_token_ids must be non-negative integers, got {t!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
