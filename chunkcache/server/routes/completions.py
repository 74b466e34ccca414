"""`POST /v1/completions`: prompts (a batch of them, texts or token lists) to text, with echo and
logprobs in the completions format, streamed or whole."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from chunkcache.outputs import RequestOutput
from chunkcache.server.choices import ChoiceGroup
from chunkcache.server.context import Context, ServerContext, sampling_params
from chunkcache.server.errors import CLIENT_CLOSED, invalid
from chunkcache.server.protocol.common import Usage
from chunkcache.server.protocol.completions import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from chunkcache.server.streaming import EventStreamResponse, collect_group, group_usage, stream_events

router = APIRouter()


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request, context: Context) -> Response:
    model = context.resolve_model(body.model)
    try:
        prompts = body.prompts()
    except ValueError as e:
        raise invalid(str(e), "prompt") from None
    for prompt in prompts:
        context.text_bound.check_prompt(prompt, "prompt")
    params = sampling_params(body)
    n = body.num_choices
    group = await context.submit_group(
        "cmpl", list(prompts), params, n, body.chunk_options(), cache_salt=body.cache_salt
    )
    tokenizer = context.engine.tokenizer
    echoes = [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts] if body.echo else None
    if body.stream:
        writer = _CompletionChunks(context, group, model, body.logprobs, echoes)
        return EventStreamResponse(stream_events(group, writer, body.include_usage_in_stream), group)
    finals = await collect_group(group, request)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED)
    choices = [_choice(context, index, finals[index], body.logprobs, echoes, n) for index in sorted(finals)]
    response = CompletionResponse(
        id=group.request_id, model=model, choices=choices, usage=group_usage(finals, n)
    )
    return JSONResponse(response.model_dump())


def _choice(
    context: ServerContext, index: int, final: RequestOutput, k: int | None, echoes: list[str] | None, n: int
) -> CompletionChoice:
    """One choice of a whole (non-streamed) response."""
    completion = final.outputs[0]
    logprobs = None
    if k is not None:
        logprobs, _ = context.logprobs.completion(
            completion, 0, len(completion.token_ids), k, len(final.prompt or "")
        )
        if echoes is not None:
            logprobs = context.logprobs.prompt(final, k).merged(logprobs)
    prefix = echoes[index // n] if echoes is not None else ""
    return CompletionChoice(
        index=index,
        text=prefix + completion.text,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
    )


class _CompletionChunks:
    """The chunks of a streamed completion: the echoed prompt goes first, in a choice's first
    chunk; logprob text offsets continue across a choice's chunks."""

    def __init__(
        self, context: ServerContext, group: ChoiceGroup, model: str, k: int | None, echoes: list[str] | None
    ) -> None:
        self._logprobs = context.logprobs
        self._group = group
        self._model = model
        self._k = k
        self._echoes = echoes
        self._created = int(time.time())
        self._text_offsets: dict[int, int] = {}
        self._echoed: set[int] = set()

    def chunk(self, index: int, output: RequestOutput) -> CompletionChunk | None:
        completion = output.outputs[0]
        logprobs = self._new_logprobs(index, output)
        text = output.new_text
        if self._echoes is not None and index not in self._echoed:
            self._echoed.add(index)
            text = self._echoes[index // self._group.n] + text
            if logprobs is not None:
                logprobs = self._logprobs.prompt(output, self._k or 0).merged(logprobs)
        if not (text or output.finished or (logprobs and logprobs.tokens)):
            return None
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=logprobs,
            finish_reason=completion.finish_reason if output.finished else None,
            stop_reason=completion.stop_reason if output.finished else None,
        )
        return self._chunk([choice])

    def _new_logprobs(self, index: int, output: RequestOutput) -> CompletionLogprobs | None:
        if self._k is None:
            return None
        completion = output.outputs[0]
        offset = self._text_offsets.setdefault(index, len(output.prompt or ""))
        end = len(completion.token_ids)
        logprobs, self._text_offsets[index] = self._logprobs.completion(
            completion, end - len(output.new_token_ids), end, self._k, offset
        )
        return logprobs

    def usage_chunk(self, usage: Usage) -> CompletionChunk:
        return self._chunk([], usage)

    def _chunk(self, choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionChunk:
        return CompletionChunk(
            id=self._group.request_id, created=self._created, model=self._model, choices=choices, usage=usage
        )
