"""Tool calling (server/tools.py): forced calls (named, required) on any model, the Hermes format
read back for tool_choice "auto", multi-turn messages with tool calls and results."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from chunkcache.config import EngineConfig
from chunkcache.engine.engine import LLMEngine
from chunkcache.server.app import build_app
from chunkcache.server.tools import ToolCall, parse_hermes, parse_required_calls, template_tool_calls
from tests.support.server_util import ServerThread
from tests.support.tiny_server import API_KEY, ENGINE_OPTIONS, MODEL

pytestmark = pytest.mark.server
jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Ashford", "Port Kellam"]}, "celsius": {"type": "boolean"}},
            "required": ["city", "celsius"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "What is the weather in Ashford?"}]

# A minimal Hermes-style template (the tool-use part of Qwen2.5's): tools listed in the system
# turn, calls written as <tool_call>{...}</tool_call>.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}"
    '{%- endfor %}\n</tools>\nFor each call return <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.tool_calls %}<|im_start|>assistant\n{%- for c in message.tool_calls %}"
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>"
    "{%- endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


def test_hermes_calls_are_read_back() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Ashford", "celsius": true}}\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    content, calls = parse_hermes(text, {"get_weather", "get_time"})
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Ashford", "celsius": True}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert parse_hermes("no calls here", {"f"}) == ("no calls here", [])
    bad = '<tool_call>{"name": "get_weather", "arguments": {</tool_call>'  # not JSON: stays text
    assert parse_hermes(bad, {"get_weather"}) == (bad, [])
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_hermes(unknown, {"get_weather"}) == (unknown, [])
    assert parse_required_calls('[{"name":"get_time","parameters":{"zone":"CET"}}]') == [
        ToolCall("get_time", '{"zone": "CET"}')
    ]
    # Templates get arguments as objects (a JSON string would be encoded twice by `tojson`).
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert template_tool_calls([call])[0]["function"]["arguments"] == {"a": 1}


def test_named_tool_choice_returns_a_valid_call(server: ServerThread, client: openai.OpenAI) -> None:
    for seed in range(3):
        got = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=40,
            seed=seed,
        ).choices[0]
        assert got.finish_reason == "stop" and got.message.content is None
        (call,) = got.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        seed=0,
        stream=True,
    )
    deltas = [c.choices[0] for c in stream if c.choices]
    assert deltas[0].delta.role == "assistant" and deltas[-1].finish_reason == "stop"
    calls = [tc for d in deltas for tc in d.delta.tool_calls or []]
    assert len(calls) == 1 and calls[0].function.name == "get_weather" and calls[0].index == 0
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS["get_weather"])
    server.wait_idle()


def test_required_tool_choice_returns_valid_calls(server: ServerThread, client: openai.OpenAI) -> None:
    for seed in range(3):
        got = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=60,
            seed=seed,
        ).choices[0]
        if got.finish_reason == "length":  # a random model may list calls past max_tokens
            assert got.message.tool_calls is None
            continue
        assert got.finish_reason == "tool_calls" and got.message.tool_calls
        for call in got.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    server.wait_idle()


def test_a_conversation_with_calls_and_results_renders(server: ServerThread, client: openai.OpenAI) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Ashford", "celsius": true}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12 degrees, rain"},
    ]  # fmt: skip
    got = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=4
    )
    assert got.choices[0].message.tool_calls is None and got.usage.prompt_tokens > 0
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        client.chat.completions.create(
            model=MODEL, messages=[*MESSAGES, {"role": "tool", "content": "x"}], max_tokens=2
        )
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
            max_tokens=2,
        )


@pytest.fixture(scope="module")
def hermes_server(model_dir) -> Iterator[ServerThread]:
    options = {**ENGINE_OPTIONS, "max_model_len": 1024}  # the tool listing is long
    engine = LLMEngine(EngineConfig.from_options(str(model_dir), use_env=False, **options))
    engine.tokenizer.chat_template = HERMES_TEMPLATE
    srv = ServerThread(build_app(engine, api_key=API_KEY, max_queue=64, served_model_name=MODEL)).start()
    yield srv
    srv.stop()


def test_auto_tool_choice_with_a_hermes_template(hermes_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{hermes_server.url}/v1", api_key=API_KEY, max_retries=0)
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0)
    got = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=6, temperature=0
    )
    # The tools reach the template (the prompt grows by their listing)...
    assert got.usage.prompt_tokens > plain.usage.prompt_tokens + 20
    # ...and this random model answers in words, which come back as content, not as a call.
    choice = got.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str)
    hermes_server.wait_idle()


def test_langchain_bind_tools_named_choice(server: ServerThread) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, max_tokens=40, seed=1, max_retries=0
    )
    bound = llm.bind_tools([WEATHER], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Ashford?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], SCHEMAS["get_weather"])
    server.wait_idle()
