"""POST /v1/chat/completions (`server/routes/chat.py`): messages, tools and response formats,
the request that holds them (its rules between fields checked at once), and the response, whole
or streamed."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from chunkcache.sampling import SamplingParams
from chunkcache.server.protocol.common import MAX_TOP_LOGPROBS, SamplingFields, StrictModel, Usage
from chunkcache.server.tools import named_call_schema, required_calls_schema, template_tool_calls


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


class ChatCompletionRequest(SamplingFields):
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
