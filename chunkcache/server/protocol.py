"""The wire format of the OpenAI-compatible API: request and response models.

Requests are strict on purpose: a field this server does not implement is rejected with HTTP 400
naming it (pydantic's `extra="forbid"`), because silently ignoring it returns an answer the client
did not ask for. Every optional field also takes an explicit `null` (= its default), as OpenAI's
API does. Fields with no effect on the answer are accepted where they mean nothing here (`user`,
`metadata`, `store=false`, `tools=[]`, `tool_choice="none"`, `response_format={"type": "text"}`,
...), and refused with a 400 saying why where they would (`store=true`, non-empty `tools`, JSON
response formats). docs/compatibility.md lists every field.

Value checks that belong to sampling (ranges of temperature, top_p, ...) are left to
`SamplingParams`, the one place that knows them; these models check shapes and the OpenAI-only rules.
"""

from __future__ import annotations

import time
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from chunkcache.config import REQUEST_CHUNK_OPTIONS, ReuseOptions
from chunkcache.sampling import SamplingParams
from chunkcache.server.tools import named_call_schema, required_calls_schema, template_tool_calls

# The largest top-logprobs count a request may ask for (OpenAI's chat limit; vLLM's default too).
MAX_TOP_LOGPROBS = 20
# Choices per prompt (OpenAI's limit) and prompts per completions request.
MAX_N = 128
MAX_PROMPTS = 256
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


class _SamplingFields(_ReuseFields):  # type: ignore[misc,valid-type]
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
    def _check_openai_rules(self) -> _SamplingFields:
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


class CompletionRequest(_SamplingFields):
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


class TextContentPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text


class MessageToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    # A participant's name: handed to the chat template, which may render it (most ignore it).
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # role "tool": the call this message answers

    @model_validator(mode="after")
    def _tool_fields(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def to_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        # "developer" is OpenAI's newer name for the system role; chat templates only know "system".
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = template_tool_calls([c.model_dump() for c in self.tool_calls])
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # arguments always follow the schema when the call is forced


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(StrictModel):
    name: str
    description: str | None = None
    # Absent: any JSON value is allowed.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    # OpenAI's strict mode: decoding under the schema's grammar is always strict here.
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_only_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format json_schema needs a json_schema object")
        if self.type != "json_schema" and self.json_schema is not None:
            raise ValueError(f"response_format {self.type!r} takes no json_schema")
        return self

    def target_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow; None for plain text."""
        if self.type == "json_object":
            return {"type": "object"}  # any JSON object (OpenAI's JSON mode)
        if self.type == "json_schema":
            assert self.json_schema is not None
            return self.json_schema.schema_ if self.json_schema.schema_ is not None else {}
        return None


class DocumentObject(StrictModel):
    """A document of `documents` (transformers' and vLLM's chat-template convention)."""

    text: str
    title: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # Chat's default is "until the context is full" (None), not the 16 of completions.
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # Tool calling (server/tools.py). parallel_tool_calls: a model may make several calls either way.
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    # vLLM's chat extensions. `documents`: each becomes one chunk of the prompt (chunk/documents.py).
    documents: list[str | DocumentObject] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False

    @model_validator(mode="after")
    def _check_chat_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        mode = self.tool_mode()
        if mode is None and self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice other than 'none' or 'auto' needs tools")
        if isinstance(self.tool_choice, NamedToolChoice):
            names = [t.function.name for t in self.tools or []]
            if self.tool_choice.function.name not in names:
                raise ValueError(
                    f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools"
                )
        if (
            mode in ("required", "named")
            and self.response_format is not None
            and self.response_format.type != "text"
        ):
            raise ValueError("a forced tool call and a JSON response_format cannot be combined")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        return self

    def tool_mode(self) -> Literal["auto", "required", "named"] | None:
        """How tools are used: None (no tools, or tool_choice "none"), "auto", "required", "named"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return "required" if self.tool_choice == "required" else "auto"

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools for the chat template (None when they are not in use)."""
        if self.tool_mode() is None:
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    def template_kwargs(self) -> dict[str, Any]:
        """Arguments of `apply_chat_template` besides the messages."""
        return {
            "add_generation_prompt": bool(self.add_generation_prompt),
            "continue_final_message": bool(self.continue_final_message),
            "chat_template_kwargs": self.chat_template_kwargs or {},
            "tools": self.tool_dicts(),
            "documents": None if self.documents is None else self.documents_json(),
        }

    def documents_json(self) -> list[str | dict[str, str]]:
        return [d if isinstance(d, str) else d.model_dump(exclude_none=True) for d in self.documents or []]

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        params = self._sampling_params(max_tokens, logprobs)
        if self.response_format is not None:
            params.json_schema = self.response_format.target_schema()
        tools = self.tool_dicts()
        mode = self.tool_mode()
        if tools and isinstance(self.tool_choice, NamedToolChoice):
            params.json_schema = named_call_schema(tools, self.tool_choice.function.name)
        elif tools and mode == "required":
            params.json_schema = required_calls_schema(tools)
        return params

    def template_messages(self) -> list[dict[str, str]]:
        return [m.to_template_message() for m in self.messages]


class PrewarmRequest(StrictModel):
    """POST /v1/chunk_cache/prewarm: a chunked prompt (its question is ignored), or a system part
    and its documents; computed and cached without generating."""

    model: str | None = None
    prompt: str | None = None
    system: str | None = None
    documents: list[str] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)
    # False: answer 202 with the job's id at once (its state at GET /v1/chunk_cache/prewarm/{id});
    # True (the default): answer when every entry is cached.
    wait: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> PrewarmRequest:
        if self.prompt is not None and (self.system is not None or self.documents is not None):
            raise ValueError("give either prompt or system and documents, not both")
        if self.prompt is None and (self.system is None or not self.documents):
            raise ValueError("give a chunked prompt, or system and a non-empty list of documents")
        return self


class PrewarmResponse(BaseModel):
    id: str
    prompt_tokens: int
    cached_tokens: int  # already cached before this request (in the pool or a lower tier)
    computed_tokens: int


class PrewarmJobStatus(BaseModel):
    """A prewarm started with `"wait": false` (GET /v1/chunk_cache/prewarm/{id}); the counts are
    PrewarmResponse's once it completed."""

    id: str
    object: Literal["chunk_cache.prewarm"] = "chunk_cache.prewarm"
    status: Literal["running", "completed", "failed", "cancelled"]
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    computed_tokens: int | None = None
    error: str | None = None


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class DeltaToolCall(ResponseToolCall):
    index: int


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


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
    tool_calls: list[DeltaToolCall] | None = None


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
