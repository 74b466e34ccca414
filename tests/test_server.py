"""The OpenAI-compatible server, end to end: a real uvicorn server on a random loopback port and the
official `openai` client (raw httpx where the wire format itself is under test)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkcache.config import EngineConfig
from chunkcache.engine.engine import LLMEngine
from chunkcache.engine_args import engine_options
from chunkcache.llm import LLM
from chunkcache.model.kernels import build
from chunkcache.sampling import SamplingParams
from chunkcache.server.cli import add_serve_arguments
from chunkcache.server.engine_loop import RETRY_AFTER_MAX, EngineLoop
from tests.support.server_util import ServerThread, free_port
from tests.support.tiny_server import API_KEY, MODEL, PROMPTS

pytestmark = pytest.mark.server
CHUNKED = "sys # # doc one # # doc two # # question"


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as c:
        yield c


def greedy(llm: LLM, prompt: str | list[int], **kw: Any) -> Any:
    params = SamplingParams(temperature=0.0, **kw)
    return llm.generate([prompt], params)[0]


def sse_events(response: httpx.Response) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


# ---- happy paths -----------------------------------------------------------------------------


def test_models_health_tokenize(server: ServerThread, client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert http.get("/health").status_code == 200
    engine = server.engine_loop.engine
    r = http.post("/tokenize", json={"prompt": PROMPTS[0]})
    assert r.status_code == 200, r.text
    expected = engine.tokenizer.encode(PROMPTS[0], add_special_tokens=True)
    assert r.json() == {"count": len(expected), "max_model_len": 256, "tokens": expected, "token_strs": None}
    r = http.post(
        "/tokenize", json={"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}
    )
    assert r.status_code == 200, r.text
    assert r.json()["count"] == len(r.json()["token_strs"]) > 0


def test_completion_equals_offline_greedy(reference: LLM, client: openai.OpenAI) -> None:
    for prompt in PROMPTS:
        want = greedy(reference, prompt, max_tokens=12)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        choice = got.choices[0]
        assert choice.text == want.outputs[0].text
        assert choice.finish_reason == want.outputs[0].finish_reason
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
        assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
        assert got.model == MODEL and got.object == "text_completion"


def test_token_prompt_equals_text_prompt(server: ServerThread, client: openai.OpenAI) -> None:
    tokens = server.engine_loop.engine.tokenizer.encode(PROMPTS[1])
    by_text = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    by_tokens = client.completions.create(model=MODEL, prompt=tokens, max_tokens=8, temperature=0)
    by_batch_of_one = client.completions.create(model=MODEL, prompt=[tokens], max_tokens=8, temperature=0)
    assert by_text.choices[0].text == by_tokens.choices[0].text == by_batch_of_one.choices[0].text


def test_completion_stream(reference: LLM, client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = PROMPTS[2]
    want = greedy(reference, prompt, max_tokens=16, ignore_eos=True)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == want.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    # The wire format itself: SSE `data:` events ending with [DONE].
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_chat_equals_offline(reference: LLM, server: ServerThread, client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Where does Mirela live?"},
    ]
    want = reference.chat(messages, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
    got = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.outputs[0].text
    assert chunks[-1].usage.completion_tokens == 12


def test_stop_string(reference: LLM, client: openai.OpenAI) -> None:
    prompt = PROMPTS[3]
    full = greedy(reference, prompt, max_tokens=24, ignore_eos=True).outputs[0].text
    # A stop string from the middle of the greedy text: the answer is everything before it.
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop.strip(), f"degenerate greedy text {full!r}"
    expected = full[: full.index(stop)]
    for stream in (False, True):
        resp = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=24,
            temperature=0,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            chunks = [c for c in resp if c.choices]
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = resp.choices[0].text, resp.choices[0].finish_reason
        assert text == expected
        assert finish == "stop"


def test_logprobs(reference: LLM, client: openai.OpenAI) -> None:
    prompt = PROMPTS[0]
    want = greedy(reference, prompt, max_tokens=6, ignore_eos=True, logprobs=3).outputs[0]
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    for i, token_id in enumerate(want.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(want.logprobs[i][token_id], abs=1e-4)
        assert 1 <= len(lp.top_logprobs[i]) <= 4
        # Greedy: the sampled token is the most likely one.
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-6)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    streamed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    tokens = [
        t.logprob
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == pytest.approx([t.logprob for t in content], abs=1e-5)


def test_chunked_prompt_is_cached_on_second_call(
    reference: LLM, client: openai.OpenAI, http: httpx.Client
) -> None:
    want = greedy(reference, CHUNKED, max_tokens=8)
    first = client.completions.create(model=MODEL, prompt=CHUNKED, max_tokens=8, temperature=0)
    second = client.completions.create(model=MODEL, prompt=CHUNKED, max_tokens=8, temperature=0)
    assert first.choices[0].text == second.choices[0].text == want.outputs[0].text
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens_details.cached_tokens
    stats = http.get("/v1/chunk_cache/stats").json()
    assert stats["enabled"] is True and stats["entries"] > 0
    # The second call, the same documents in the same order, read the first one's blended KV.
    assert stats["blended_prefix_hits"] > 0


def test_per_request_chunk_options(reference: LLM, client: openai.OpenAI) -> None:
    options = {
        "chunk_layout": "offset",
        "blend_check_layers": [0],
        "blend_recompute_ratios": [0.5],
        "blend_selector": "stored_deviation",
    }
    want = reference.generate(
        CHUNKED, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), chunk_options=options
    )[0]
    got = client.completions.create(
        model=MODEL, prompt=CHUNKED, max_tokens=6, temperature=0, extra_body={"ignore_eos": True, **options}
    )
    assert got.choices[0].text == want.outputs[0].text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": CHUNKED}],
        max_tokens=4,
        temperature=0,
        extra_body={"chunk_layout": "isolated"},
    )
    assert chat.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt=CHUNKED, max_tokens=4, extra_body={"blend_recompute_ratios": [2.0]}
        )
    assert "blend_recompute_ratios" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL,
            prompt=CHUNKED,
            max_tokens=4,
            extra_body={"chunk_layout": "offset", "blend_check_layers": [9]},
        )
    assert "out of range" in str(info.value)


def test_metrics(server: ServerThread, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    # With --api-key, /metrics needs it too (serve --metrics-without-api-key leaves it open).
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    for name in (
        'chunkcache_http_requests_total{endpoint="/v1/completions",status="200"}',
        "chunkcache_time_to_first_token_seconds_count",
        "chunkcache_inter_token_latency_seconds_count",
        "chunkcache_prompt_tokens_total",
        "chunkcache_cached_prompt_tokens_total",
        "chunkcache_generation_tokens_total",
        'chunkcache_request_success_total{finish_reason="length"}',
        "chunkcache_num_requests_waiting",
        "chunkcache_num_requests_running",
        "chunkcache_kv_cache_usage_ratio",
        "chunkcache_chunk_cache_bytes",
        "chunkcache_chunk_cache_hit_ratio",
        "chunkcache_chunk_cache_blended_prefix_hits_total",
        "chunkcache_chunk_cache_exact_prefix_hits_total",
        "chunkcache_kv_blocks",
    ):
        assert name in text, name
    # Which kernels serve: the state this process's library is in (the server runs in it).
    serving = build.kernels().kind
    for kind in ("c", "torch"):
        assert f'chunkcache_kernels{{kind="{kind}"}} {1.0 if kind == serving else 0.0}' in text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for family in families.values():
        # A gauge never ends in _total (Prometheus reserves it for counters).
        assert not (family.type == "gauge" and family.name.endswith("_total")), family.name
    for name in (
        "chunkcache_kv_cache_usage_ratio",
        "chunkcache_chunk_cache_hit_ratio",
        "chunkcache_chunk_cache_usage_ratio",
    ):
        assert 0.0 <= families[name].samples[0].value <= 1.0

    # vLLM's names and labels (vllm/v1/metrics/loggers.py), what llm-d's scheduler and vLLM dashboards read.
    def vllm_value(name: str, sample: str | None = None, **labels: str) -> float:
        family = families[name]
        want = {"model_name": MODEL, "engine": "0", **labels}
        values = [s.value for s in family.samples if s.name == (sample or name) and s.labels == want]
        assert len(values) == 1, (name, family.samples)
        return values[0]

    assert families["vllm:num_requests_running"].type == "gauge"
    assert vllm_value("vllm:num_requests_running") == 0 and vllm_value("vllm:num_requests_waiting") == 0
    assert 0.0 <= vllm_value("vllm:kv_cache_usage_perc") <= 1.0
    assert families["vllm:prefix_cache_queries"].type == "counter"
    queries = vllm_value("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    assert queries >= len(PROMPTS[0].split())
    assert 0 <= vllm_value("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") <= queries
    assert vllm_value("vllm:generation_tokens", "vllm:generation_tokens_total") >= 4
    assert vllm_value("vllm:request_success", "vllm:request_success_total", finished_reason="length") >= 1
    assert vllm_value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count") >= 1
    assert vllm_value("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") >= 1
    assert "vllm:inter_token_latency_seconds" in families
    assert vllm_value("vllm:num_preemptions", "vllm:num_preemptions_total") >= 0


# ---- errors ----------------------------------------------------------------------------------


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    return body["error"]


@pytest.mark.parametrize(
    ("path", "body", "status", "needle", "param"),
    [
        ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty", None),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias", "logit_bias"),
        ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 200}}, 400, "logit_bias", "logit_bias"),
        ("/v1/completions", {"prompt": "x", "store": True}, 400, "does not store", None),
        ("/v1/completions", {"prompt": "x", "service_tier": "flex"}, 400, "service_tier", "service_tier"),
        ("/v1/completions", {"prompt": CHUNKED, "echo": True, "logprobs": 1}, 400, "chunked prompts", None),
        ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens", None),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix", None),
        (
            "/v1/completions",
            {"prompt": "x", "frobnicate": 1},
            400,
            "unsupported field 'frobnicate'",
            "frobnicate",
        ),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature", "temperature"),
        ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "n"),
        ("/v1/completions", {"prompt": "x", "n": 129}, 400, "n", "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens"),
        ("/v1/completions", {"prompt": ["a"] * 257}, 400, "batch of 257 prompts", "prompt"),
        ("/v1/completions", {"prompt": [10**9]}, 400, "token id", None),
        ("/v1/completions", {"max_tokens": 3}, 400, "missing required field 'prompt'", "prompt"),
        ("/v1/completions", {"prompt": "x", "model": "nope"}, 404, "nope", "model"),
        ("/v1/completions", {"prompt": "hello " * 400}, 400, "max_model_len", "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "documents": ["hello " * 400]},
            400,
            "max_model_len",
            "documents",
        ),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10_000}, 400, "max_tokens", None),
        ("/v1/chat/completions", {"messages": []}, 400, "messages", "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "robot", "content": "x"}]},
            400,
            "role",
            "messages.0.role",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"type": "function", "function": {"name": "f"}}],
            },
            400,
            "tool_choice 'auto' needs a chat template",
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
            400,
            "tool_choice",
            None,
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "nonsense"}},
                },
            },
            400,
            "invalid JSON schema",
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
            400,
            "needs a json_schema",
            None,
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"tokenize": True}},
            400,
            "chat_template_kwargs may not set",
            None,
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "continue_final_message": True,
                "add_generation_prompt": False,
            },
            400,
            "continue_final_message needs the last message",
            None,
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            400,
            "top_logprobs requires logprobs",
            None,
        ),
    ],
)
def test_error_cases(
    http: httpx.Client, path: str, body: dict[str, Any], status: int, needle: str, param: str | None
) -> None:
    err = _error(http.post(path, json=body), status)
    assert needle in err["message"]
    if param is not None:
        assert err["param"] == param


def test_error_statuses_through_the_client(server: ServerThread, client: openai.OpenAI) -> None:
    bad_key = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad_key.completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert e.value.status_code == 401 and "API key" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"best_of": 3})
    assert "best_of" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # as OpenAI answers a prompt over the context
        client.completions.create(model=MODEL, prompt="hello " * 400, max_tokens=2)
    assert e.value.code == "context_length_exceeded"


def test_malformed_json_and_unknown_route(http: httpx.Client) -> None:
    err = _error(
        http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400
    )
    assert "not valid JSON" in err["message"]
    _error(http.get("/v1/nothing-here"), 404)


def _chat_with(extra: str) -> str:
    """A small chat body (raw JSON text) with `extra` fields."""
    return '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ' + extra + "}"


_DEEP = '{"a": ' * 900 + "1" + "}" * 900


@pytest.mark.parametrize(
    ("path", "raw", "param", "needle"),
    [
        # Lone surrogates wherever the server tokenizes: a 400 naming the field, not the tokenizer's 500.
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
            "messages.0.content",
            "surrogate",
        ),
        ("/v1/chat/completions", _chat_with('"documents": ["a \\udfff"]'), "documents.0", "surrogate"),
        (
            "/v1/chat/completions",
            _chat_with('"documents": [{"text": "a", "title": "\\ud800"}]'),
            "documents.0.title",
            "surrogate",
        ),
        ("/v1/completions", '{"prompt": ["ok", "hi \\ud800"]}', "prompt.1", "surrogate"),
        ("/v1/chunk_cache/prewarm", '{"system": "\\ud800", "documents": ["x"]}', "system", "surrogate"),
        ("/tokenize", '{"prompt": "hi \\ud800"}', "prompt", "surrogate"),
        # Token ids outside the vocabulary (the tiny model has 1024 tokens).
        ("/v1/completions", '{"prompt": "hi", "logit_bias": {"1024": 5}}', "logit_bias", "vocabulary"),
        (
            "/v1/completions",
            '{"prompt": "hi", "stop_token_ids": [5, 99999999]}',
            "stop_token_ids",
            "vocabulary",
        ),
        (
            "/v1/completions",
            '{"prompt": "hi", "logit_bias": {"' + "9" * 5000 + '": 1}}',
            "logit_bias",
            "token ids",
        ),
        ("/v1/completions", '{"prompt": "hi", "stop_token_ids": [1e20]}', "stop_token_ids.0", "integer"),
        # Schema errors and nesting name the field, with the depth limit stated.
        (
            "/v1/chat/completions",
            _chat_with(
                '"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "x"}}}'
            ),
            "response_format",
            "invalid JSON schema",
        ),
        (
            "/v1/chat/completions",
            _chat_with('"chat_template_kwargs": ' + _DEEP),
            "chat_template_kwargs",
            "64 levels",
        ),
        (
            "/v1/chat/completions",
            _chat_with(
                '"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": '
                + _DEEP
                + "}}"
            ),
            "response_format",
            "64 levels",
        ),
        ("/v1/completions", "[" * 100_000 + "]" * 100_000, None, "64 levels"),
        ("/v1/completions", b'{"prompt": "hi \xff\xfe"}', None, "not valid UTF-8"),
    ],
)
def test_bad_text_and_ids_name_their_field(
    http: httpx.Client, path: str, raw: str | bytes, param: str | None, needle: str
) -> None:
    content = raw if isinstance(raw, bytes) else raw.encode()
    err = _error(http.post(path, content=content, headers={"content-type": "application/json"}), 400)
    assert needle in err["message"] and err["param"] == param
    assert http.post("/v1/completions", json={"prompt": "hi \U0001f600", "max_tokens": 2}).status_code == 200


def test_internal_error_is_not_leaked(
    server: ServerThread, http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(server.engine_loop.engine, "render_chat", broken)
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
    err = _error(r, 500)
    assert "secret" not in r.text and err["type"] == "server_error"
    monkeypatch.undo()
    # ... and the server keeps serving.
    r = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    )
    assert r.status_code == 200, r.text


def test_retry_after_is_the_mean_gap_between_first_tokens() -> None:
    loop = EngineLoop(cast(LLMEngine, None), max_queue=1)
    assert loop.retry_after() == 1  # nothing left the queue yet
    loop._left.extend([10.0, 13.0, 16.0, 19.0])
    assert loop.retry_after() == 3
    loop._left.clear()
    loop._left.extend([0.0, 0.2])
    assert loop.retry_after() == 1
    loop._left.extend([900.0])
    assert loop.retry_after() == RETRY_AFTER_MAX


def test_queue_full_is_503(server: ServerThread, http: httpx.Client) -> None:
    loop = server.engine_loop
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0}
    old = loop.max_queue
    loop.max_queue = 2
    try:
        with ThreadPoolExecutor(2) as pool, loop.paused():
            # While the engine is held, two requests fill the queue and stay waiting.
            pending = [pool.submit(http.post, "/v1/completions", json=body) for _ in range(2)]
            deadline = time.monotonic() + 10
            while loop.num_waiting < 2:
                assert time.monotonic() < deadline, "requests did not reach the queue"
                time.sleep(0.01)
            refused = http.post("/v1/completions", json=body)
            err = _error(refused, 503)
            assert err["code"] == "queue_full" and "max_queue=2" in err["message"]
            assert int(refused.headers["Retry-After"]) >= 1
        assert [f.result().status_code for f in pending] == [200, 200]
    finally:
        loop.max_queue = old
    server.wait_idle()


# ---- load, disconnects, integrity ------------------------------------------------------------


def test_32_concurrent_streams(reference: LLM, server: ServerThread) -> None:
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(32)]
    want = {p: greedy(reference, p, max_tokens=16, ignore_eos=True).outputs[0].text for p in prompts}

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    got = asyncio.run(run_all())
    assert got == [want[p] for p in prompts]
    stats = server.wait_idle()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    server.on_engine(server.engine_loop.engine.check_integrity)


def _aborted(server: ServerThread) -> float:
    return server.engine_loop.metrics.finished_requests.labels(finish_reason="abort")._value.get()


def test_client_hangs_up_mid_stream(server: ServerThread, http: httpx.Client) -> None:
    aborted = _aborted(server)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        # Leaving the block closes the connection with the stream unfinished.
    stats = server.wait_idle()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert _aborted(server) == aborted + 1
    server.on_engine(server.engine_loop.engine.check_integrity)


def test_client_gives_up_on_non_streamed_request(server: ServerThread) -> None:
    aborted = _aborted(server)
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "ignore_eos": True}
    loop = server.engine_loop
    with loop.paused():
        # The engine is held, so the request cannot finish before the client times out.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{server.url}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {API_KEY}"},
                timeout=1.0,
            )
        deadline = time.monotonic() + 10
        while loop.num_in_flight:
            assert time.monotonic() < deadline, "the abandoned request was not released"
            time.sleep(0.01)
    stats = server.wait_idle()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert _aborted(server) == aborted + 1


# ---- the command line ------------------------------------------------------------------------


def test_cli_flags_cover_engine_options() -> None:
    parser = add_serve_arguments(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--model", "m", "--no-enable-chunk-cache", "--max-num-seqs", "4", "--chunk-cache-size-gb", "0.5"]
    )
    assert args.host == "127.0.0.1"
    assert engine_options(args) == {
        "enable_chunk_cache": False,
        "max_num_seqs": 4,
        "chunk_cache_size_gb": 0.5,
    }
    config = EngineConfig.from_options(args.model, use_env=False, **engine_options(args))
    assert config.chunk.enable is False and config.scheduler.max_num_seqs == 4


def test_sigterm_drains_in_flight_requests(model_dir: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "chunkcache.server.cli", "--model", str(model_dir), "--dtype", "float32"]
    cmd += ["--port", str(port)]
    cmd += [
        "--device",
        "cpu",
        "--kv-cache-tokens",
        "4096",
        "--max-model-len",
        "256",
        "--log-level",
        "warning",
    ]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        body = {"prompt": PROMPTS[0], "max_tokens": 120, "ignore_eos": True, "stream": True, "temperature": 0}
        texts: list[str] = []
        first_event = threading.Event()

        def consume() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                for event in sse_events(r):
                    first_event.set()
                    texts.append(event)

        reader = threading.Thread(target=consume)
        reader.start()
        assert first_event.wait(30)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert texts[-1] == "[DONE]"
        finals = [json.loads(e)["choices"][0] for e in texts[:-1]]
        assert finals[-1]["finish_reason"] == "length"
        # uvicorn re-raises the captured signal once it has shut down cleanly, so the exit status
        # is the conventional "terminated by SIGTERM"; the drain itself is asserted above.
        assert proc.wait(60) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
