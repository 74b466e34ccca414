"""The wire format of the OpenAI-compatible API: request and response models.

Requests are strict on purpose: a field this server does not implement is rejected with HTTP 400
naming it (pydantic's `extra="forbid"`), because silently ignoring, say, `presence_penalty=1.5`
returns an answer the client did not ask for. A few fields that popular clients send at their
neutral value (`n=1`, zero penalties, `echo=false`) are accepted only at that value.

Value checks that belong to sampling (ranges of temperature, top_p, ...) are left to
`SamplingParams`, the one place that knows them; these models check shapes and the OpenAI-only rules.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from chunkcache.config import REQUEST_CHUNK_OPTIONS
from chunkcache.sampling import SamplingParams

# The largest top-logprobs count a request may ask for (OpenAI's chat limit; vLLM's default too).
MAX_TOP_LOGPROBS = 20


class StrictModel(BaseModel):
    # NaN and Infinity (which Python's JSON parser accepts) are refused in every float field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = False


class _SamplingFields(StrictModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted only at their no-op value: common clients send them even when unused.
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an opaque end-user id for the caller's own bookkeeping; no effect on output
    # vLLM's extensions.
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # vLLM's: requests share cached KV only with requests of the same salt (tenant isolation).
    cache_salt: str | None = Field(default=None, min_length=1)
    # chunkcache's extensions: this request's chunk layout and blend options (ChunkConfig).
    chunk_layout: str | None = None
    blend_check_layers: list[int] | None = None
    blend_recompute_ratios: list[float] | None = None
    blend_selector: str | None = None
    blend_threshold: float | None = None
    blend_boundary_tokens: int | None = None
    blend_min_tokens: int | None = None

    @model_validator(mode="after")
    def _check_openai_rules(self) -> _SamplingFields:
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported: this server returns one choice per request")
        if self.presence_penalty != 0.0:
            raise ValueError(f"presence_penalty={self.presence_penalty} is not supported; only 0")
        if self.frequency_penalty != 0.0:
            raise ValueError(f"frequency_penalty={self.frequency_penalty} is not supported; only 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def chunk_options(self) -> dict[str, Any] | None:
        """The chunk extension fields that were given, for `LLMEngine.add_request`."""
        options = {
            name: getattr(self, name) for name in REQUEST_CHUNK_OPTIONS if getattr(self, name) is not None
        }
        return options or None

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        # OpenAI's defaults (temperature 1, top_p 1) are SamplingParams' defaults too.
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "logprobs": logprobs,
        }
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.top_p is not None:
            kwargs["top_p"] = self.top_p
        if self.top_k is not None:
            kwargs["top_k"] = self.top_k
        return SamplingParams(**kwargs)


class CompletionRequest(_SamplingFields):
    # A string, a token list, or a batch of exactly one of either.
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion_rules(self) -> CompletionRequest:
        if self.echo:
            raise ValueError("echo=true is not supported")
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of={self.best_of} is not supported; only 1")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt[0], int):
            return prompt  # type: ignore[return-value]
        if len(prompt) != 1:
            raise ValueError(
                f"a batch of {len(prompt)} prompts is not supported; send one prompt per request"
            )
        return prompt[0]  # type: ignore[return-value]

    def to_sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextContentPart] | None = None

    def to_template_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # "developer" is OpenAI's newer name for the system role; chat templates only know "system".
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Chat's default is "until the context is full" (None), not the 16 of completions.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_chat_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)

    def template_messages(self) -> list[dict[str, str]]:
        return [m.to_template_message() for m in self.messages]


class TokenizeRequest(StrictModel):
    """vLLM's /tokenize: either a prompt or chat messages."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    """A streamed completion event: OpenAI reuses the `text_completion` object for chunks."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "chunkcache"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
