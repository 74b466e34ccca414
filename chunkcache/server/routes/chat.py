"""`POST /v1/chat/completions`: messages rendered by the model's chat template, then generated like
any prompt; tool calls read back from the answer's text, logprobs in the chat format."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from chunkcache.errors import InvalidRequestError, PromptTooLongError
from chunkcache.outputs import CompletionOutput, RequestOutput
from chunkcache.server.choices import ChoiceGroup
from chunkcache.server.context import Context, ServerContext, sampling_params
from chunkcache.server.errors import CLIENT_CLOSED, invalid
from chunkcache.server.protocol.chat import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    NamedToolChoice,
    ResponseToolCall,
)
from chunkcache.server.protocol.common import Usage
from chunkcache.server.streaming import EventStreamResponse, collect_group, group_usage, stream_events
from chunkcache.server.tools import (
    HERMES_TAG,
    ToolCall,
    parse_hermes,
    parse_required_calls,
    template_speaks_hermes,
)

router = APIRouter()

# (content, tool calls, whether the calls make the finish reason "tool_calls") of an answer's text.
ToolReader = Callable[[str], tuple[str | None, list[ToolCall], bool]]


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, context: Context) -> Response:
    model = context.resolve_model(body.model)
    params = sampling_params(body)
    reader = _tool_reader(body, context)
    # The rendered text goes through the same chunk parsing as any prompt (docs/design.md §2). As in
    # `LLM.chat` and vLLM, the template writes the special prefix (BOS) itself.
    messages, template_kwargs = body.template_messages(), body.template_kwargs()
    engine = context.engine
    prompt = await context.engine_loop.run_off_loop(lambda: engine.render_chat(messages, **template_kwargs))
    context.text_bound.check_prompt(prompt, "documents" if body.documents else "messages")
    n = body.num_choices
    try:
        group = await context.submit_group(
            "chatcmpl",
            [prompt],
            params,
            n,
            body.chunk_options(),
            add_special_tokens=False,
            cache_salt=body.cache_salt,
        )
    except PromptTooLongError as e:
        if e.param in (None, "prompt"):  # the engine's name: here the text came from these fields
            e.param = "documents" if body.documents else "messages"
        raise
    except InvalidRequestError as e:
        if e.param == "json_schema":  # the engine's name; the schema came from one of these fields
            e.param = "tools" if body.tool_mode() in ("required", "named") else "response_format"
        raise
    k = (body.top_logprobs or 0) if body.logprobs else None
    if body.stream:
        writer = _ChatChunks(context, group, model, k, reader)
        return EventStreamResponse(stream_events(group, writer, body.include_usage_in_stream), group)
    finals = await collect_group(group, request)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = [_choice(context, index, finals[index].outputs[0], k, reader) for index in sorted(finals)]
    response = ChatCompletionResponse(
        id=group.request_id, model=model, choices=choices, usage=group_usage(finals, n)
    )
    return JSONResponse(response.model_dump())


def _tool_reader(body: ChatCompletionRequest, context: ServerContext) -> ToolReader | None:
    """How tool calls are read back from an answer, None without tools; 400 for tool_choice 'auto'
    when the template's call format is not one this server can parse."""
    tool_mode = body.tool_mode()
    if tool_mode is None:
        return None
    if tool_mode == "auto" and not template_speaks_hermes(
        getattr(context.engine.tokenizer, "chat_template", None)
    ):
        raise invalid(
            "tool_choice 'auto' needs a chat template whose tool calls this server can read back "
            f"(the {HERMES_TAG} format of Qwen2.5, Qwen3 and Hermes); this model's template has none. "
            "Use tool_choice 'required' or a named function, which work with any model",
            "tool_choice",
        )
    tool_names = {t.function.name for t in body.tools or []}

    def read_tools(text: str) -> tuple[str | None, list[ToolCall], bool]:
        if tool_mode == "named":
            assert isinstance(body.tool_choice, NamedToolChoice)
            return None, [ToolCall(body.tool_choice.function.name, text)], False
        if tool_mode == "required":
            return None, parse_required_calls(text), True
        content, calls = parse_hermes(text, tool_names)  # "auto"
        return content, calls, bool(calls)

    return read_tools


def _choice(
    context: ServerContext, index: int, completion: CompletionOutput, k: int | None, reader: ToolReader | None
) -> ChatChoice:
    """One choice of a whole (non-streamed) response."""
    message, finish_reason = assistant_message(completion, reader)
    return ChatChoice(
        index=index,
        message=message,
        logprobs=None if k is None else context.logprobs.chat(completion, 0, len(completion.token_ids), k),
        finish_reason=finish_reason,
        stop_reason=completion.stop_reason,
    )


def assistant_message(
    completion: CompletionOutput, reader: ToolReader | None
) -> tuple[AssistantMessage, str | None]:
    """The answer as an assistant message, tool calls read back when tools are in use. A forced
    call cut short by max_tokens is not valid JSON: it stays text, finish "length"."""
    if reader is None or completion.finish_reason != "stop":
        return AssistantMessage(content=completion.text), completion.finish_reason
    try:
        content, calls, calls_finish = reader(completion.text)
    except ValueError:  # the JSON did not parse: the model's words are returned as they are
        return AssistantMessage(content=completion.text), completion.finish_reason
    message = AssistantMessage(
        content=content,
        tool_calls=[ResponseToolCall.model_validate(c.to_openai()) for c in calls] or None,
    )
    return message, "tool_calls" if calls_finish else completion.finish_reason


class _ChatChunks:
    """The chunks of a streamed chat completion. OpenAI announces the role once per choice, in its
    first chunk. With tools in use, a choice's text is held back and sent whole at its end, as
    content and tool_calls deltas (a call can only be read once complete)."""

    def __init__(
        self, context: ServerContext, group: ChoiceGroup, model: str, k: int | None, reader: ToolReader | None
    ) -> None:
        self._logprobs = context.logprobs
        self._group = group
        self._model = model
        self._k = k
        self._reader = reader
        self._created = int(time.time())
        self._role_sent: set[int] = set()

    def chunk(self, index: int, output: RequestOutput) -> ChatCompletionChunk | None:
        completion = output.outputs[0]
        logprobs = None
        if self._k is not None and output.new_token_ids:
            end = len(completion.token_ids)
            logprobs = self._logprobs.chat(completion, end - len(output.new_token_ids), end, self._k)
        if not (output.new_text or output.finished or logprobs):
            return None
        role = None if index in self._role_sent else "assistant"
        self._role_sent.add(index)
        finish_reason = completion.finish_reason if output.finished else None
        if self._reader is None:
            delta = DeltaMessage(role=role, content=output.new_text)
        elif not output.finished:
            if role is None:
                return None  # nothing to say until the answer is complete
            delta = DeltaMessage(role=role, content="")
        else:
            delta, finish_reason = self._final_delta(completion, role)
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=logprobs,
            finish_reason=finish_reason,
            stop_reason=completion.stop_reason if output.finished else None,
        )
        return self._chunk([choice])

    def _final_delta(self, completion: CompletionOutput, role: str | None) -> tuple[DeltaMessage, str | None]:
        """A tool-using choice's whole answer, as content and tool_calls deltas."""
        message, finish_reason = assistant_message(completion, self._reader)
        calls = [
            DeltaToolCall.model_validate({**c.model_dump(), "index": i})
            for i, c in enumerate(message.tool_calls or [])
        ]
        return DeltaMessage(role=role, content=message.content, tool_calls=calls or None), finish_reason

    def usage_chunk(self, usage: Usage) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def _chunk(self, choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._group.request_id, created=self._created, model=self._model, choices=choices, usage=usage
        )
