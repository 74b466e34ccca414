"""POST /v1/completions (`server/routes/completions.py`): the request (a prompt, a token list or
a batch of either) and the response, whole or streamed."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from chunkcache.sampling import SamplingParams
from chunkcache.server.protocol.common import MAX_TOP_LOGPROBS, SamplingFields, Usage

# Prompts per completions request.
MAX_PROMPTS = 256


class CompletionRequest(SamplingFields):
    # A string, a token list, or a batch of either: choice i of prompt p has index p * n + i.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions (null: up to the context)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion_rules(self) -> CompletionRequest:
        if self.best_of not in (None, 1, self.n):
            raise ValueError(f"best_of={self.best_of} is not supported; only 1 (or equal to n)")
        if self.suffix:
            raise ValueError(
                "suffix is not supported: no model served here is trained for fill-in-the-middle"
            )
        return self

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(
                f"a batch of {len(prompt)} prompts is more than this server takes ({MAX_PROMPTS})"
            )
        return list(prompt)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        params = self._sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            # echo + logprobs = the prompt tokens' logprobs too (evaluation harnesses' loglikelihood).
            params.prompt_logprobs = self.logprobs
            params.validate()
        return params


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)

    def merged(self, after: CompletionLogprobs) -> CompletionLogprobs:
        """These entries followed by `after`'s (echoed prompt, then the completion)."""
        return CompletionLogprobs(
            tokens=self.tokens + after.tokens,
            token_logprobs=self.token_logprobs + after.token_logprobs,
            top_logprobs=self.top_logprobs + after.top_logprobs,
            text_offset=self.text_offset + after.text_offset,
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extension: the stop string or token id that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    """A streamed completion event: OpenAI reuses the `text_completion` object for chunks."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
