"""Tool calling for /v1/chat/completions: the request's tools go to the chat template, and the
model's answer is read back as OpenAI `tool_calls`.

- `tool_choice` a named function: the output is constrained (engine/structured.py) to that
  function's arguments, a JSON object valid under its `parameters` schema; the call is that object.
- `tool_choice: "required"`: the output is constrained to a non-empty JSON array of
  `{"name": <one of the tools>, "parameters": {...}}`, each item valid under its tool's schema.
  These two work with any model, as in vLLM.
- `tool_choice: "auto"` (the default with tools): the model decides, in its own format. Parsed
  here: the Hermes format `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` that Qwen2.5,
  Qwen3 and Hermes templates teach; other templates are refused (400), since their calls could
  not be read back.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

HERMES_TAG = "<tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call["index"] = index
        return call


def parameters_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's arguments schema; OpenAI lets `parameters` be absent (no arguments)."""
    schema = tool["function"].get("parameters")
    return schema if schema is not None else {"type": "object", "properties": {}}


def named_call_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for tool in tools:
        if tool["function"]["name"] == name:
            return parameters_schema(tool)
    raise ValueError(f"tool_choice names function {name!r}, which is not among the tools")


def required_calls_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """A non-empty array of calls, each naming one tool with arguments valid for that tool."""
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": tool["function"]["name"]},
                        "parameters": parameters_schema(tool),
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for tool in tools
            ]
        },
    }


def parse_required_calls(text: str) -> list[ToolCall]:
    """The calls of a `required` answer (a JSON array under `required_calls_schema`)."""
    return [ToolCall(item["name"], json.dumps(item["parameters"])) for item in json.loads(text)]


def template_speaks_hermes(chat_template: str | None) -> bool:
    return bool(chat_template) and HERMES_TAG in chat_template


def parse_hermes(text: str, tool_names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content before the first call, calls) of a Hermes-format answer. A call whose JSON does not
    parse or names no known tool is not a call: the whole answer is then returned as content."""
    start = text.find(HERMES_TAG)
    if start < 0:
        return text, []
    calls = []
    for body in _HERMES_CALL.findall(text[start:]):
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or obj.get("name") not in tool_names:
            return text, []
        arguments = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            ToolCall(obj["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))
        )
    content = text[:start].strip()
    return content or None, calls


def template_tool_calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """An assistant message's OpenAI tool_calls as chat templates read them: arguments as an object
    (Qwen's and Llama's templates dump them with `tojson`; a JSON string would be encoded twice)."""
    out = []
    for call in tool_calls:
        function = dict(call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            # Not JSON: the template gets the text as it was sent.
            with contextlib.suppress(json.JSONDecodeError):
                function["arguments"] = json.loads(arguments)
        out.append({**call, "function": function})
    return out
