"""What every route's models share: the strict base (unknown fields and NaN refused), the
sampling fields of completions and chat (with chunkcache's reuse options, derived from
`config.ReuseOptions`), usage, and the error body. See the package docstring for the rules."""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from chunkcache.config import REQUEST_CHUNK_OPTIONS, ReuseOptions
from chunkcache.sampling import SamplingParams

# The largest top-logprobs count a request may ask for (OpenAI's chat limit; vLLM's default too).
MAX_TOP_LOGPROBS = 20
# Choices per prompt (OpenAI's limit).
MAX_N = 128
# A token id has at most this many digits (vocabularies hold well under 10**9 tokens).
MAX_TOKEN_ID_DIGITS = 9


class StrictModel(BaseModel):
    # NaN and Infinity (which Python's JSON parser accepts) are refused in every float field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    # OpenAI pads streamed deltas with random characters against side channels when asked; a
    # self-hosted server sends no padding, so either value means the same here.
    include_obfuscation: bool | None = None


def _wire_type(hint: Any) -> Any:
    """A ReuseOptions type as a JSON body gives it: a tuple of numbers is a JSON array (a list)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if len(args) == 1 and typing.get_origin(args[0]) is tuple:
        return list[typing.get_args(args[0])[0]] | None  # type: ignore[index]
    return hint


# chunkcache's extensions: a request's own chunk layout, blend and fusion options, one field per
# ReuseOptions field (its name and type), declared there once.
_ReuseFields = create_model(
    "_ReuseFields",
    __base__=StrictModel,
    **{name: (_wire_type(hint), None) for name, hint in typing.get_type_hints(ReuseOptions).items()},  # type: ignore[call-overload]
)


class SamplingFields(_ReuseFields):  # type: ignore[misc,valid-type]
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # n choices per prompt; choices after the first start once the first has its prompt in the
    # prefix cache, so they share its KV (server/choices.py).
    n: int | None = Field(default=None, ge=1, le=MAX_N)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias
    user: str | None = None  # an opaque end-user id for the caller's own bookkeeping; no effect on output
    # Bookkeeping fields of OpenAI's platform: nothing is stored here, so only "not stored" is honest.
    store: bool | None = None
    metadata: dict[str, str] | None = None  # tags for stored completions; no effect without storage
    service_tier: Literal["auto", "default"] | None = None  # one tier here; others would be a promise
    # vLLM's extensions.
    top_k: int | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    # vLLM's: requests share cached KV only with requests of the same salt (tenant isolation).
    cache_salt: str | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _check_openai_rules(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.store:
            raise ValueError("store=true is not supported: this server does not store completions")
        return self

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        # Checked here, as a field, so that the error names it; digits are bounded before int()
        # sees them (Python refuses to convert more than 4,300 digits, with a message naming none).
        for key in bias or {}:
            digits = key.lstrip("-")
            if not digits.isdigit() or len(digits) > MAX_TOKEN_ID_DIGITS:
                shown = key if len(key) <= 24 else f"{key[:20]}... ({len(key)} characters)"
                raise ValueError(f"logit_bias keys must be token ids, got {shown!r}")
        return bias

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def chunk_options(self) -> ReuseOptions | None:
        """The chunk extension fields, for `LLMEngine.add_request`; None when none was given."""
        given = {
            name: getattr(self, name) for name in REQUEST_CHUNK_OPTIONS if getattr(self, name) is not None
        }
        return ReuseOptions.from_mapping(given) if given else None

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        # OpenAI's defaults (temperature 1, top_p 1) are SamplingParams' defaults too.
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": bool(self.ignore_eos),
            "logprobs": logprobs,
        }
        optional = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
        }
        kwargs.update({name: value for name, value in optional.items() if value is not None})
        if self.logit_bias:
            kwargs["logit_bias"] = {int(token): bias for token, bias in self.logit_bias.items()}
        return SamplingParams(**kwargs)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
