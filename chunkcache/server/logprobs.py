"""Log-probabilities in OpenAI's two response shapes, from one reading of the engine's entries.

The engine gives, per position, a dict {token id: logprob} (the sampled token and the top k) or
nothing. `positions` turns a span of them into `Position`s once; the completions format (generated
tokens, and the echoed prompt) and the chat format are two spellings of that list.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from chunkcache.outputs import CompletionOutput, RequestOutput
from chunkcache.server.protocol.chat import ChatLogprobs, ChatTokenLogprob, TopLogprob
from chunkcache.server.protocol.completions import CompletionLogprobs

# JSON has no infinity (Starlette refuses to encode it): an impossible token's logprob is sent as
# this floor instead, as vLLM does.
LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class TokenStrings:
    """Decoded text of single tokens, for logprobs; memoized because the vocabulary is finite and
    the same tokens recur across requests."""

    def __init__(self, tokenizer: Decoder) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._cache[token_id] = text
        return text


@dataclass(frozen=True)
class Position:
    """One token of a span: its text, its (finite) logprob if the engine gave one, and the k most
    likely alternatives, most likely first (None where the engine gave no entry at all)."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]] | None


class LogprobWriter:
    """Builds the logprobs of responses for one server (its tokenizer's memoized token strings)."""

    def __init__(self, tokenizer: Decoder) -> None:
        self.token_str = TokenStrings(tokenizer)

    def positions(
        self,
        token_ids: Sequence[int],
        entries: Sequence[dict[int, float] | None],
        start: int,
        stop: int,
        k: int,
    ) -> Iterator[Position]:
        for i in range(start, stop):
            token_id = token_ids[i]
            lp = entries[i] if i < len(entries) else None
            token = self.token_str(token_id)
            if lp is None:
                yield Position(token, None, None)
                continue
            sampled = lp.get(token_id)
            ranked = sorted(lp.items(), key=lambda kv: kv[1], reverse=True)[:k]
            top = [(self.token_str(t), finite(v)) for t, v in ranked]
            yield Position(token, None if sampled is None else finite(sampled), top)

    def completion(
        self, completion: CompletionOutput, start: int, stop: int, k: int, text_offset: int
    ) -> tuple[CompletionLogprobs, int]:
        """Logprobs of generated tokens [start, stop) in the completions format; also returns the
        text offset after them (offsets continue across streamed chunks). A generated token without
        an entry gets no logprob and an empty top dict (the prompt's first token gets None)."""
        spans = self.positions(completion.token_ids, completion.logprobs or [], start, stop, k)
        return _completion_format(spans, text_offset, missing_top={})

    def prompt(self, output: RequestOutput, k: int) -> CompletionLogprobs:
        """The prompt tokens in the completions format, for echo (the first has no logprob)."""
        ids = output.prompt_token_ids
        spans = self.positions(ids, output.prompt_logprobs or [], 0, len(ids), k)
        return _completion_format(spans, 0, missing_top=None)[0]

    def chat(self, completion: CompletionOutput, start: int, stop: int, k: int) -> ChatLogprobs:
        """Logprobs of generated tokens [start, stop) in the chat format."""
        spans = self.positions(completion.token_ids, completion.logprobs or [], start, stop, k)
        return ChatLogprobs(content=[_chat_token(p) for p in spans])


def _completion_format(
    spans: Iterator[Position], text_offset: int, missing_top: dict[str, float] | None
) -> tuple[CompletionLogprobs, int]:
    result = CompletionLogprobs()
    for p in spans:
        result.tokens.append(p.token)
        result.token_logprobs.append(p.logprob)
        result.text_offset.append(text_offset)
        text_offset += len(p.token)
        if p.top is None:
            result.top_logprobs.append(None if missing_top is None else dict(missing_top))
            continue
        top = dict(p.top)
        if p.logprob is not None:
            top.setdefault(p.token, p.logprob)
        result.top_logprobs.append(top)
    return result, text_offset


def _chat_token(p: Position) -> ChatTokenLogprob:
    return ChatTokenLogprob(
        token=p.token,
        logprob=LOGPROB_FLOOR if p.logprob is None else p.logprob,
        bytes=list(p.token.encode()),
        top_logprobs=[TopLogprob(token=t, logprob=v, bytes=list(t.encode())) for t, v in p.top or []],
    )
