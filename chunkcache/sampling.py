"""Sampling parameters of a request (vLLM-like), validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

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
    # ---- penalties and logit processing (vLLM's meanings; applied in engine/sampler.py) ----
    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this times the token's count in the output
    repetition_penalty: float = 1.0  # prompt and output tokens: logit / p if > 0 else logit * p
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop tokens are masked, stop strings ignored, before this many
    skip_special_tokens: bool = True  # in the returned text
    prompt_logprobs: int | None = None  # top-k log-probabilities of each prompt token (vLLM's name)
    json_schema: dict[str, Any] | None = None  # output must be JSON valid under it (engine/structured.py)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        """ValueError naming the first option out of range, checked group by group in a fixed
        order (the one a 400 names when several are wrong): how a token is drawn, what the reply
        holds, where it stops, then the logit processing."""
        self._validate_drawing()
        self._validate_output()
        self._validate_stops()
        self._validate_processing()

    def _validate_drawing(self) -> None:
        """Temperature, top_p and top_k: the distribution each token is drawn from."""
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:  # NaN fails the comparison
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off), 0 (off) or a positive integer, got {self.top_k!r}")

    def _validate_output(self) -> None:
        """The reply's length, its log-probabilities, and the seed that reproduces it: each None
        (unbounded, none, random) or an integer in range."""
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

    def _validate_stops(self) -> None:
        """Stop strings and token ids: bounded in number and size first (they are matched after
        every token), then each one's type."""
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

    def _validate_processing(self) -> None:
        """What changes the logits (penalties, logit bias, a JSON schema, min_tokens) and the
        prompt's log-probabilities."""
        self._validate_penalties()
        self._validate_logit_bias()
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError(
                f"json_schema must be a JSON schema object, got {type(self.json_schema).__name__}"
            )
        k = self.prompt_logprobs
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
            raise ValueError(f"prompt_logprobs must be a non-negative integer, got {k!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")

    def _validate_penalties(self) -> None:
        """Presence and frequency penalties in OpenAI's range [-2, 2]; the repetition penalty
        divides or multiplies logits, so it is finite and > 0."""
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not isinstance(rp, int | float) or not math.isfinite(rp) or rp <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {rp!r}")

    def _validate_logit_bias(self) -> None:
        """A map of token ids to biases in OpenAI's range [-100, 100], or None."""
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError("logit_bias must map token ids to numbers")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {token!r}")
            if not isinstance(bias, int | float) or not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")

    @property
    def processes_logits(self) -> bool:
        """Whether the raw logits are changed before sampling (penalties, bias, min_tokens)."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS
