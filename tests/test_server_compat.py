"""OpenAI / vLLM request shapes that clients send (issue 17): explicit nulls, no-op fields, n > 1,
batches of prompts, echo, penalties, chat template options; the official `openai` client and
langchain-openai against a real server, the offline API as the reference."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from chunkcache.llm import LLM
from chunkcache.sampling import SamplingParams
from tests.support.server_util import ServerThread
from tests.support.tiny_server import API_KEY, MODEL, PROMPTS

pytestmark = pytest.mark.server
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Where does Mirela live?"},
]
LONG = " ".join(PROMPTS * 3)  # several full KV blocks


def greedy_chat(reference: LLM, messages: list[dict[str, Any]], n: int = 10) -> str:
    return (
        reference.chat(messages, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        .outputs[0]
        .text
    )


def test_explicit_nulls_mean_defaults(reference: LLM, server: ServerThread, client: openai.OpenAI) -> None:
    want = greedy_chat(reference, MESSAGES)
    got = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_completion_tokens=10,
        n=None,
        presence_penalty=None,
        frequency_penalty=None,
        logprobs=None,
        top_logprobs=None,
        logit_bias=None,
        seed=None,
        stop=None,
        top_p=None,
        user=None,
        stream=None,
        max_tokens=None,
        tools=None,
        tool_choice=None,
        parallel_tool_calls=None,
        response_format=None,
        store=None,
        metadata=None,
        service_tier=None,
        extra_body={"ignore_eos": True, "min_tokens": None, "repetition_penalty": None, "top_k": None},
    )
    assert got.choices[0].message.content == want
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "n": None, "echo": None,
            "logprobs": None, "best_of": None, "suffix": None, "presence_penalty": None, "stream": None}  # fmt: skip
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    want_text = reference.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=6))[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == want_text
    server.wait_idle()


def test_no_op_fields_leave_the_answer_alone(reference: LLM, client: openai.OpenAI) -> None:
    want = greedy_chat(reference, MESSAGES)
    common: dict[str, Any] = {
        "model": MODEL,
        "messages": MESSAGES,
        "temperature": 0,
        "max_tokens": 10,
        "tools": [],
        "tool_choice": "none",
        "parallel_tool_calls": False,
        "response_format": {"type": "text"},
        "store": False,
        "metadata": {"team": "search"},
        "service_tier": "auto",
        "user": "user-1",
        "extra_body": {"ignore_eos": True},
    }
    assert client.chat.completions.create(**common).choices[0].message.content == want
    stream = client.chat.completions.create(
        **common, stream=True, stream_options={"include_usage": True, "include_obfuscation": False}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 10
    # messages[].name reaches the template (this one does not render it, so the answer is the same).
    named = [MESSAGES[0], {**MESSAGES[1], "name": "mirela_fan"}]
    assert client.chat.completions.create(**{**common, "messages": named}).choices[0].message.content == want


def _choices_text(response) -> dict[int, str]:
    return {c.index: c.text for c in response.choices}


def vllm_metric(server: ServerThread, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not exported")


def test_n_choices_are_seeded_per_choice_and_share_the_prompt_kv(
    reference: LLM,
    server: ServerThread,
    client: openai.OpenAI,
) -> None:
    prompt_ids = reference.engine.tokenizer.encode(LONG)
    full_blocks = (len(prompt_ids) - 1) // 16 * 16
    assert full_blocks >= 48
    hits_before = vllm_metric(server, "vllm:prefix_cache_hits_total")
    got = client.completions.create(
        model=MODEL, prompt=LONG, n=3, temperature=1.0, seed=11, max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in got.choices) == [0, 1, 2]
    for c in got.choices:
        # Choice i samples with seed + i (vLLM's parallel sampling), so each is reproducible alone.
        params = SamplingParams(temperature=1.0, seed=11 + c.index, max_tokens=8, ignore_eos=True)
        want = reference.generate(LONG, params)[0]
        assert c.text == want.outputs[0].text
    assert len(set(_choices_text(got).values())) > 1
    # Choices 1 and 2 started from choice 0's prompt KV: their whole full blocks were cache hits.
    assert vllm_metric(server, "vllm:prefix_cache_hits_total") - hits_before >= 2 * full_blocks
    assert got.usage.prompt_tokens == len(prompt_ids)  # the prompt counts once
    assert got.usage.completion_tokens == 3 * 8
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=2, seed=5, temperature=1.0, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    texts: dict[int, str] = {}
    roles: dict[int, list[str | None]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            roles.setdefault(c.index, []).append(c.delta.role)
    assert sorted(texts) == [0, 1] and all(
        r[0] == "assistant" and set(r[1:]) <= {None} for r in roles.values()
    )
    assert chunks[-1].usage.completion_tokens == 12
    full = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=2,
        seed=5,
        temperature=1.0,
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert {c.index: c.message.content for c in full.choices} == texts
    server.wait_idle()


def test_prompt_batches_and_echo(reference: LLM, server: ServerThread, client: openai.OpenAI) -> None:
    prompts = [PROMPTS[0], PROMPTS[2]]
    got = client.completions.create(model=MODEL, prompt=prompts, n=2, temperature=0, max_tokens=5, echo=True)
    assert sorted(c.index for c in got.choices) == [0, 1, 2, 3]
    for c in got.choices:
        prompt = prompts[c.index // 2]  # choice i of prompt p is p * n + i
        want = reference.generate(prompt, SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].text
        assert c.text == prompt + want
    token_prompt = reference.engine.tokenizer.encode(PROMPTS[1])
    streamed = client.completions.create(
        model=MODEL, prompt=[token_prompt], max_tokens=4, temperature=0, echo=True, stream=True
    )
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    want = reference.generate([token_prompt], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    assert text == reference.engine.tokenizer.decode(token_prompt) + want
    server.wait_idle()


def test_penalties_bias_and_min_tokens_equal_the_offline_api(reference: LLM, client: openai.OpenAI) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=12, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2,
        logit_bias={5: -100.0, 9: 3.0}, min_tokens=4, skip_special_tokens=False,
    )  # fmt: skip
    want = reference.generate(PROMPTS[3], params)[0].outputs[0].text
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[3],
        temperature=0,
        max_tokens=12,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        logit_bias={"5": -100, "9": 3},
        extra_body={"repetition_penalty": 1.2, "min_tokens": 4, "skip_special_tokens": False},
    )
    assert got.choices[0].text == want
    plain = reference.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    assert want != plain


def test_chat_template_options(reference: LLM, client: openai.OpenAI) -> None:
    engine = reference.engine
    tokenizer = engine.tokenizer

    def prompt_tokens(**kw: Any) -> int:
        got = client.chat.completions.create(model=MODEL, max_tokens=1, temperature=0, **kw)
        return got.usage.prompt_tokens

    plain = prompt_tokens(messages=MESSAGES)
    no_gen = prompt_tokens(messages=MESSAGES, extra_body={"add_generation_prompt": False})
    rendered = engine.render_chat(MESSAGES, add_generation_prompt=False)
    assert no_gen == len(tokenizer.encode(rendered, add_special_tokens=False)) < plain
    partial = [*MESSAGES, {"role": "assistant", "content": "Mirela lives in"}]
    cont = prompt_tokens(
        messages=partial, extra_body={"add_generation_prompt": False, "continue_final_message": True}
    )
    rendered = engine.render_chat(partial, add_generation_prompt=False, continue_final_message=True)
    assert rendered.endswith("Mirela lives in")  # the answer continues the assistant's words
    assert cont == len(tokenizer.encode(rendered, add_special_tokens=False))
    # Template variables: this template has none, so they change nothing; they never reach the
    # rendering arguments (a 400, tested in test_server.py).
    assert (
        prompt_tokens(messages=MESSAGES, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        == plain
    )


def test_chat_template_kwargs_reach_the_template(reference: LLM) -> None:
    tokenizer = reference.engine.tokenizer
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = "{{ greeting }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
        rendered = reference.engine.render_chat(
            [{"role": "user", "content": "x"}], chat_template_kwargs={"greeting": "HELLO "}
        )
        assert rendered == "HELLO x"
    finally:
        tokenizer.chat_template = original


# ---- langchain-openai -----------------------------------------------------------------------


def test_langchain_invoke_stream_and_named_message(reference: LLM, server: ServerThread) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage

    llm = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=f"{server.url}/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=10,
        max_retries=0,
        extra_body={"ignore_eos": True},
    )
    messages = [SystemMessage(MESSAGES[0]["content"]), HumanMessage(MESSAGES[1]["content"])]
    want = greedy_chat(reference, MESSAGES)
    assert llm.invoke(messages).content == want
    assert "".join(chunk.content for chunk in llm.stream(messages)) == want
    named = [SystemMessage(MESSAGES[0]["content"]), HumanMessage(MESSAGES[1]["content"], name="mirela_fan")]
    assert llm.invoke(named).content == want
    server.wait_idle()


def test_echo_with_logprobs_returns_prompt_logprobs(
    reference: LLM, server: ServerThread, client: openai.OpenAI
) -> None:
    """What evaluation harnesses send for a loglikelihood: echo, logprobs, max_tokens 1."""
    prompt = PROMPTS[2]
    got = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0
    )
    lp = got.choices[0].logprobs
    want = reference.generate(
        prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, logprobs=2)
    )[0]
    ids = want.prompt_token_ids
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(want.prompt_logprobs[i][ids[i]], abs=1e-5)
        assert len(lp.top_logprobs[i]) >= 2
    assert lp.token_logprobs[-1] == pytest.approx(
        want.outputs[0].logprobs[0][want.outputs[0].token_ids[0]], abs=1e-5
    )
    assert got.choices[0].text == prompt + want.outputs[0].text
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0, stream=True
        )
    )
    first = next(c for c in streamed if c.choices)
    assert first.choices[0].logprobs.token_logprobs[: len(ids)] == lp.token_logprobs[: len(ids)]
    server.wait_idle()


# ---- structured output ----------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Ashford", "Port Kellam"]}, "sure": {"type": "boolean"}},
    "required": ["city", "sure"],
    "additionalProperties": False,
}


def test_json_schema_response_format(server: ServerThread, client: openai.OpenAI) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for seed in range(3):
        got = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=40,
            seed=seed,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True},
            },
        )
        assert got.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(got.choices[0].message.content), SCHEMA)
    server.wait_idle()


def test_langchain_json_mode(server: ServerThread, client: openai.OpenAI) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    # A random tiny model may write a JSON object longer than max_tokens; find a seed whose
    # object closes, then langchain must parse exactly that object.
    for seed in range(16):
        raw = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=24, seed=seed, response_format={"type": "json_object"}
        ).choices[0]
        assert raw.message.content.startswith("{")
        if raw.finish_reason == "stop":
            break
    else:
        pytest.fail("no seed gave a closed JSON object")
    want = json.loads(raw.message.content)
    assert isinstance(want, dict)
    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, max_tokens=24, seed=seed, max_retries=0
    )
    structured = llm.with_structured_output(method="json_mode")
    assert structured.invoke([("system", MESSAGES[0]["content"]), ("human", MESSAGES[1]["content"])]) == want
    server.wait_idle()


def test_a_client_leaving_an_n_choice_stream_frees_every_choice(server: ServerThread) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPTS[1],
        "n": 3,
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    aborted = aborts(server)
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        seen: set[int] = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == 3:
                break  # every choice is running; hang up
    stats = server.wait_idle()  # no request left, every KV block free
    assert stats["num_running"] == 0
    assert aborts(server) - aborted == 3  # all three were aborted, none ran to its 200 tokens


def aborts(server: ServerThread) -> float:
    text = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "vllm:request_success_total"
                and sample.labels.get("finished_reason") == "abort"
            ):
                return sample.value
    return 0.0
