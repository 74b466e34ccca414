"""The server's one logprob reader (server/logprobs.py) in OpenAI's two shapes, on hand-made engine
entries: the cases the three builders it replaced each handled their own way (a position without an
entry, a sampled token outside the top k, -inf, echo's prompt whose first token has no logprob)."""

from __future__ import annotations

import math

from chunkcache.outputs import CompletionOutput, RequestMetrics, RequestOutput
from chunkcache.server.logprobs import LOGPROB_FLOOR, LogprobWriter


class _Letters:
    """Token i decodes to the i-th lower-case letter; counts decodes (the writer memoizes them)."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, token_ids: list[int]) -> str:
        self.calls += 1
        return "".join(chr(ord("a") + t) for t in token_ids)


def _completion(token_ids: list[int], logprobs: list[dict[int, float]]) -> CompletionOutput:
    return CompletionOutput(index=0, text="", token_ids=token_ids, logprobs=logprobs, finish_reason=None)


def test_completion_format_ranks_keeps_the_sampled_token_and_continues_offsets() -> None:
    # Token 3 sampled at position 0 but outside the top 1; position 2 has no entry at all.
    completion = _completion([3, 1, 2], [{0: -0.1, 3: -2.5}, {1: -math.inf, 0: -0.5}])
    result, offset = LogprobWriter(_Letters()).completion(completion, 0, 3, 1, text_offset=7)
    assert result.tokens == ["d", "b", "c"]
    assert result.token_logprobs == [-2.5, LOGPROB_FLOOR, None]  # -inf is sent as the floor
    assert result.top_logprobs == [{"a": -0.1, "d": -2.5}, {"a": -0.5, "b": LOGPROB_FLOOR}, {}]
    assert result.text_offset == [7, 8, 9] and offset == 10


def test_prompt_format_for_echo_has_no_logprob_for_the_first_token() -> None:
    output = RequestOutput(
        request_id="r",
        prompt="abc",
        prompt_token_ids=[0, 1, 2],
        outputs=[],
        finished=True,
        metrics=RequestMetrics(arrival_time=0.0),
        prompt_logprobs=[None, {1: -0.2, 4: -0.1}, {2: -1.0}],
    )
    result = LogprobWriter(_Letters()).prompt(output, 2)
    assert result.tokens == ["a", "b", "c"]
    assert result.token_logprobs == [None, -0.2, -1.0]
    assert result.top_logprobs == [None, {"e": -0.1, "b": -0.2}, {"c": -1.0}]
    assert result.text_offset == [0, 1, 2]


def test_chat_format_spans_a_slice_with_bytes_and_floors_missing_entries() -> None:
    letters = _Letters()
    writer = LogprobWriter(letters)
    completion = _completion([0, 1, 2], [{0: -1.0}, {1: -0.3, 2: -0.4, 0: -3.0}])
    content = writer.chat(completion, 1, 3, 2).content
    assert [c.token for c in content] == ["b", "c"]
    assert content[0].logprob == -0.3 and content[0].bytes == [ord("b")]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("b", -0.3), ("c", -0.4)]
    assert content[1].logprob == LOGPROB_FLOOR and content[1].top_logprobs == []  # no entry
    assert letters.calls == 2  # b and c (the top's tokens too): each decoded once
    writer.chat(completion, 1, 3, 2)
    assert letters.calls == 2  # memoized across calls
